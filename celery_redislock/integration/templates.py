"""Resource templates of ``@locked`` and ``UniqueTask``: checked, bound, formatted.

A template is a ``str.format`` string over a task's bound arguments
(``"repo:{repo_id}"``). Its fields name parameters: ``{repo.id}`` and
``{ids[0]}`` look up ``repo`` and ``ids``; positional fields (``{}``,
``{0}``) are refused. The rules are checked twice: the template itself and
its names against the function's parameters when the task is made
(:func:`template_list`, :func:`check_fields`), the call's arguments when it
runs (:class:`ArgumentBinder`, :func:`format_all`).

Also here: the holder record a task's locks carry (:func:`holder_info`),
built from the same task and request.
"""

from __future__ import annotations

import functools
import inspect
import string
from collections.abc import Iterable, Mapping
from typing import Any

from ..exceptions import ConfigurationError, LockError


class TemplateError(LockError, ValueError):
    """A resource template cannot be formatted from the task's arguments.

    Raised when ``@locked`` decorates a function whose parameters do not
    include a name the template uses (at import time), or when a call lacks
    an argument or has a value the template cannot format (before anything
    is locked). Attributes: ``template``, ``argument``, ``task`` and
    ``detail`` (None, or what went wrong when it is not a missing argument).
    """

    def __init__(
        self,
        template: str,
        argument: str = "?",
        task: str = "the task",
        detail: str | None = None,
    ) -> None:
        self.template = template
        self.argument = argument
        self.task = task
        self.detail = detail
        # args are the fields, so the error survives Celery's result backend.
        super().__init__(template, argument, task, detail)

    def __str__(self) -> str:
        # UniqueTask labels its key template '<task name>.unique_key'.
        kind = "unique_key" if self.task.endswith(".unique_key") else "@locked"
        if self.detail is not None:
            return f"{kind} template {self.template!r} of {self.task}: {self.detail}"
        return (
            f"{kind} template {self.template!r} of {self.task} needs argument "
            f"{self.argument!r}, which this call does not have; pass it or fix the template"
        )


def fields(template: str) -> list[tuple[str, str | None]]:
    """``(root name, conversion)`` of every field, nested spec fields included.

    The root is what the template looks up in the arguments: ``repo`` for
    ``{repo.id}`` and ``{repo[0]}``; ``""`` or digits for positional fields.
    Raises ValueError for a malformed template (unbalanced braces).
    """
    out: list[tuple[str, str | None]] = []
    for _, field, spec, conversion in string.Formatter().parse(template):
        if field is None:
            continue
        out.append((field.split(".", 1)[0].split("[", 1)[0], conversion))
        if spec:
            out.extend(fields(spec))
    return out


@functools.lru_cache(maxsize=1024)
def _roots(template: str) -> tuple[str, ...]:
    """The argument names ``template`` looks up (parsed once per template)."""
    return tuple(field for field, _ in fields(template))


def format_all(templates: Iterable[str], args: Mapping[str, Any], task: str) -> list[str]:
    """Every template formatted from ``args`` (name -> value), in order.

    Raises :class:`TemplateError` (labelled ``task``) for an argument a
    template names and ``args`` lacks, or a value it cannot format.
    """
    out = []
    for template in templates:
        for field in _roots(template):
            if field not in args:
                raise TemplateError(template, field, task)
        try:
            out.append(template.format_map(args))
        except (KeyError, AttributeError, IndexError, TypeError, ValueError) as exc:
            raise TemplateError(
                template,
                str(exc),
                task,
                f"cannot be formatted from this call's arguments ({type(exc).__name__}: {exc})",
            ) from exc
    return out


def check_templates(name: str, templates: Iterable[Any]) -> tuple[str, ...]:
    """Type and syntax of the templates, checked before any function is seen.

    ``name`` labels the :class:`ConfigurationError` (``"locked"`` for the
    exclusive templates of ``@locked``, which get hints of their own).
    """
    out = []
    for t in templates:
        if isinstance(t, (list, tuple, set, frozenset)) and name == "locked":
            raise ConfigurationError(
                name,
                f"exclusive templates are separate arguments, not a {type(t).__name__}: "
                f"write @locked('a', 'b'), not @locked(['a', 'b']) ({t!r})",
            )
        if callable(t) and name == "locked":
            raise ConfigurationError(
                name,
                f"was applied to {getattr(t, '__qualname__', t)!r} without templates: "
                "write @locked('repo:{repo_id}', ...), not a bare @locked",
            )
        if not isinstance(t, str) or not t:
            raise ConfigurationError(name, f"resource templates must be non-empty str, not {t!r}")
        try:
            found = fields(t)
        except ValueError as exc:
            raise ConfigurationError(name, f"template {t!r} is malformed: {exc}") from None
        for field, conversion in found:
            if conversion not in (None, "r", "s", "a"):
                raise ConfigurationError(
                    name,
                    f"template {t!r} has conversion !{conversion} in field {{{field}...}}; "
                    "use !r, !s or !a",
                )
        out.append(t)
    return tuple(out)


def template_list(name: str, value: Any) -> tuple[str, ...]:
    """``value`` (one template, or an iterable of them) as checked templates."""
    if isinstance(value, str):
        return check_templates(name, [value])
    if isinstance(value, (bytes, bytearray)) or not isinstance(value, Iterable):
        raise ConfigurationError(name, f"must be a str template or a list of them, not {value!r}")
    return check_templates(name, value)


def _parameter_list(sig: inspect.Signature) -> str:
    names = []
    for p in sig.parameters.values():
        if p.kind is inspect.Parameter.VAR_POSITIONAL:
            names.append("*" + p.name)
        elif p.kind is inspect.Parameter.VAR_KEYWORD:
            names.append("**" + p.name)
        else:
            names.append(p.name)
    return ", ".join(names)


def check_fields(templates: Iterable[str], sig: inspect.Signature, label: str) -> None:
    """Every template's root names must be parameters of the function.

    A function with ``**kwargs`` may receive any name: only positional
    fields are refused then, the names are checked at each call.
    """
    params = sig.parameters
    var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    names = [p.name for p in params.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    example = next((n for n in names if n != "self"), "repo_id")
    for template in templates:
        for field, _ in fields(template):
            if field == "" or field.isdigit():
                raise TemplateError(
                    template,
                    field or "{}",
                    label,
                    f"has a positional field {{{field}}}; templates name parameters, "
                    f"e.g. {{{example}}} (parameters of {label}: "
                    f"{_parameter_list(sig) or 'none'})",
                )
            if field not in names and not var_kw:
                raise TemplateError(
                    template,
                    field,
                    label,
                    f"names {field!r}, which is not a parameter of {label}; its parameters "
                    f"are: {_parameter_list(sig) or 'none'}. Fix the template or the "
                    "function's parameters",
                )


class ArgumentBinder:
    """Binds a call's arguments to a function's signature, by name.

    :meth:`bind` gives the mapping templates are formatted from: every
    parameter (defaults applied), with the names ``**kwargs`` took merged
    in (a named parameter wins over a same-named keyword only ``**kwargs``
    could take, possible with positional-only ones).
    """

    __slots__ = ("label", "signature", "var_keyword")

    def __init__(self, signature: inspect.Signature, label: str) -> None:
        self.signature = signature
        #: Names the function in the TypeError of a call that does not fit.
        self.label = label
        #: The name of the ``**kwargs`` parameter, or None.
        self.var_keyword = next(
            (
                p.name
                for p in signature.parameters.values()
                if p.kind is inspect.Parameter.VAR_KEYWORD
            ),
            None,
        )

    def bind(self, args: Any, kwargs: Any) -> dict[str, Any]:
        """The call's arguments by name; TypeError (naming the function)
        when they do not fit the signature."""
        try:
            bound = self.signature.bind(*args, **kwargs)
        except TypeError as exc:
            raise TypeError(f"{self.label}: {exc}") from exc
        bound.apply_defaults()
        mapping = dict(bound.arguments)
        if self.var_keyword is not None:
            for key, value in (mapping.pop(self.var_keyword, None) or {}).items():
                mapping.setdefault(key, value)
        return mapping


def bind_arguments(
    signature: inspect.Signature, args: Any, kwargs: Any, label: str
) -> dict[str, Any]:
    """One call's :meth:`ArgumentBinder.bind` (for a signature bound once)."""
    return ArgumentBinder(signature, label).bind(args, kwargs)


def holder_info(task: Any, label: str, nodename: str | None = None) -> str:
    """What the lock records about a task holder: ``name\nid\nnode``.

    Recorded with the grant (the holder record, the resource's value in the
    owner's registry) only when the locks are taken from a task, and shown
    by ``redislock locks`` and the Inspector.
    The node is the worker's node name (``celery@host``), else the request's
    hostname.
    """
    request = getattr(task, "request", None) if task is not None else None
    name = getattr(task, "name", None) or label
    return holder_record(name, getattr(request, "id", None), nodename, request)


def holder_record(name: Any, task_id: Any, nodename: str | None, request: Any) -> str:
    """:func:`holder_info` from the task's name and id, already looked up."""
    node = nodename or getattr(request, "hostname", None) or ""
    return "\n".join(str(x).replace("\n", " ") for x in (name, task_id or "", node))
