"""Key names of one namespace, and validation of resource names.

Every key shares the hash tag ``{namespace}`` so each script is single-slot
(Redis Cluster ready) and an ACL can be limited to ``~{namespace}:*``.

=============================  ======  =========================================
key                            type    holds
=============================  ======  =========================================
``{ns}:lock:<resource>``       hash    holder token -> ``x`` | ``s`` | ``l``,
                                       then the fence (a slot: ``:<N>``)
``{ns}:q:<resource>``          zset    ``<mode><token>`` scored by arrival
``{ns}:held:<owner>``          hash    the owner's registry: resource -> ``''``,
                                       or a task's holder record
                                       (:func:`holder_record`)
``{ns}:held:<owner>|``         hash    bucket index of a registry that spilled
                                       (an owner holding many locks): b -> ``''``
``{ns}:held:<owner>|<b>``      hash    one bucket of it (values as above)
``{ns}:alive:<owner>``         string  the owner's liveness (TTL); value = who
``{ns}:owners``                set     owners that may hold or wait for locks
``{ns}:req:<token>``           hash    one request's state (queued / granted)
``{ns}:wake:<token>``          list    wake-up pushed to one waiting request
``{ns}:waits:<owner>``         hash    the owner's queued requests: token ->
                                       modes and resource names
``{ns}:contended:<resource>``  stream  one entry, added when a holder blocks
                                       a request; exists only while a holder
                                       waits in wait_for_contender (TTL)
``{ns}:lost:<owner>``          list    pushed when the owner is declared dead
``{ns}:dead:<owner>``          string  tombstone of a cleaned owner (TTL);
                                       value = why ('operator', 'dead', '1')
``{ns}:holder:<token>``        string  ``task name\ntask id\nnode`` of a grant
                                       taken by a Celery task, written by
                                       earlier releases only (now the
                                       registry value: holder_record)
``{ns}:adopted:<task owner>``  hash    who adopted a task owner's locks, and
                                       the grants (TTL; see adopt.lua)
``{ns}:defer:<task id>``        hash    a deferred task's park record
                                       (docs/defer.md)
``{ns}:deferred``              zset    task id -> next re-attempt (ms)
``{ns}:deadlines``             zset    task id -> park or grant deadline (ms)
``{ns}:guardslot``             string  next free time of the deferred tasks'
                                       guards' schedule (ms; expires once past)
``{ns}:dispatch``              list    task ids to dispatch again
``{ns}:dispatching:<inc>``     list    ids one worker is dispatching
``{ns}:dispatcher:<inc>``      string  that dispatcher's liveness (TTL)
``{ns}:dispatchers``           set     incarnations that dispatch
``{ns}:fence``                 string  last fencing token
``{ns}:born``                  string  the first fencing token of this data
                                       set (written with the fence: a Redis
                                       that lost its data has a later one)
``{ns}:seq``                   string  last arrival sequence number
``{ns}:format``                string  data-format version of the namespace
                                       (:data:`FORMAT_VERSION`)
=============================  ======  =========================================
"""

from __future__ import annotations

import hashlib
import itertools
import os
import re
import secrets
import socket

from ..exceptions import ConfigurationError, InvalidResource

#: Version of the shape of the lock data in Redis (the keys above, their
#: values, the scripts' encodings). Bump it with any change that a process of
#: the previous release would misread: processes of two formats refuse to
#: share a namespace (:class:`~celery_redislock.exceptions.FormatMismatch`;
#: docs/operations.md, "Upgrading across a data-format change"). Stored in
#: ``{ns}:format`` by the first process that uses the namespace. Format 1 is
#: the layout of the releases from before versioning (uuid owner ids and
#: tokens, set registries); format 2 has compact owner ids and request ids
#: and hash registries; format 3 lets the registry of an owner holding many
#: locks spill into buckets (``{ns}:held:<owner>|<b>``, which a format-2
#: cleanup would not see).
FORMAT_VERSION = 3
#: The format of data written by releases from before format versioning (a
#: namespace with a fencing counter and no ``{ns}:format`` key).
UNVERSIONED_FORMAT = 1

#: Longest resource name accepted, in UTF-8 bytes.
MAX_RESOURCE_BYTES = 512
#: Most resources one request may name.
MAX_RESOURCES = 64

#: A namespace, matched against the whole string (``fullmatch``: a ``$``
#: anchor would also accept a trailing newline).
_NAMESPACE_RE = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
_CONTROL_RE = re.compile(r"[\x00-\x1f\x7f]")


def text(value: object, errors: str = "strict") -> str:
    """A reply value as ``str``: ``bytes`` decoded as UTF-8 (``errors`` as for
    :meth:`bytes.decode`; ``"replace"`` for what is only shown), anything
    else through ``str()`` (replies are bytes unless the client decodes them)."""
    return value.decode("utf-8", errors) if isinstance(value, bytes) else str(value)


def validate_namespace(namespace: object) -> str:
    """Return ``namespace`` if usable as a hash tag, else raise ConfigurationError."""
    if not isinstance(namespace, str) or not _NAMESPACE_RE.fullmatch(namespace):
        raise ConfigurationError(
            "namespace",
            f"{namespace!r} must be 1-64 characters of letters, digits, '_', '.' or '-'",
        )
    return namespace


def validate_resource(name: object) -> str:
    """Return ``name`` if it is a valid resource name, else raise InvalidResource.

    A name is a non-empty ``str`` of at most :data:`MAX_RESOURCE_BYTES` UTF-8
    bytes without control characters. Any such name is safe: it only ever
    becomes the suffix of a key inside the namespace.
    """
    if not isinstance(name, str):
        raise InvalidResource(
            f"resource names must be str, not {type(name).__name__}: {name!r}", name
        )
    if not name:
        raise InvalidResource("resource name is empty", name)
    if len(name.encode("utf-8", "surrogatepass")) > MAX_RESOURCE_BYTES:
        raise InvalidResource(
            f"resource name longer than {MAX_RESOURCE_BYTES} bytes: {name[:40]!r}...", name
        )
    if _CONTROL_RE.search(name):
        raise InvalidResource(f"resource name has control characters: {name!r}", name)
    try:
        name.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidResource(f"resource name is not valid UTF-8: {name!r}", name) from exc
    return name


def validate_owner_id(owner_id: object) -> str:
    """Return ``owner_id`` if it can name an owner, else raise ValueError.

    An owner id is a non-empty ``str`` without ``|`` (the token separator) or
    control characters, of at most :data:`MAX_RESOURCE_BYTES` UTF-8 bytes.
    """
    if (
        not isinstance(owner_id, str)
        or not owner_id
        or "|" in owner_id
        or _CONTROL_RE.search(owner_id)
        or len(owner_id.encode("utf-8", "surrogatepass")) > MAX_RESOURCE_BYTES
    ):
        raise ValueError(f"not an owner id: {owner_id!r}")
    return owner_id


#: Prefix of the owner id of a task owner (locks held on behalf of a task
#: message, until the process that runs it adopts them).
TASK_OWNER_PREFIX = "task:"


def validate_task_id(task_id: object) -> str:
    """Return ``task_id`` if it can name a task owner, else raise ValueError.

    Celery task ids are uuids by default, but any ``str`` a caller passes as
    ``task_id`` is accepted when it is safe as part of a key and a holder
    token: non-empty, at most :data:`MAX_RESOURCE_BYTES` UTF-8 bytes less the
    ``task:`` prefix, no ``|`` and no control characters. Whatever it holds,
    it only ever becomes the suffix of a key inside the namespace.
    """
    if not isinstance(task_id, str):
        raise ValueError(f"a task id must be a str, not {type(task_id).__name__}: {task_id!r}")
    try:
        validate_owner_id(TASK_OWNER_PREFIX + task_id)
    except ValueError:
        raise ValueError(
            f"not a usable task id (empty, too long, or has '|' or control characters): {task_id!r}"
        ) from None
    if not task_id:
        raise ValueError("a task id must not be empty")
    try:
        task_id.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"a task id must be valid UTF-8: {task_id!r}") from exc
    return task_id


def task_owner_id(task_id: str, attempt: int = 0) -> str:
    """The owner id of task ``task_id``'s owner (validated).

    ``task:<task id>`` for a task's first message, ``task+<n>:<task id>``
    for the message of its n-th retry (the same task id is sent again, and a
    task owner once adopted is tombstoned, so each attempt has its own).
    """
    validate_task_id(task_id)
    if isinstance(attempt, bool) or not isinstance(attempt, int) or attempt < 0:
        raise ValueError(f"attempt must be an int >= 0, not {attempt!r}")
    if attempt == 0:
        return TASK_OWNER_PREFIX + task_id
    return f"task+{attempt}:{task_id}"


#: Prefix of the task owner of a deferred task's park record (life 0);
#: ``defer+<life>:`` for later lives. Apart from :data:`TASK_OWNER_PREFIX`,
#: so that a task both unique and deferred keeps its two task owners apart.
DEFER_OWNER_PREFIX = "defer:"


def defer_owner_id(task_id: str, life: int = 0) -> str:
    """The task owner of life ``life`` of deferred task ``task_id``'s park
    record (validated): ``defer:<task id>``, ``defer+<life>:<task id>``.

    Its token is still ``<owner>|task:<task id>`` (:func:`task_token`). An
    earlier release named these owners as :func:`task_owner_id` does; the
    park record keeps the token it was written with, which is what the
    scripts read.
    """
    validate_task_id(task_id)
    if isinstance(life, bool) or not isinstance(life, int) or life < 0:
        raise ValueError(f"life must be an int >= 0, not {life!r}")
    owner = DEFER_OWNER_PREFIX + task_id if life == 0 else f"defer+{life}:{task_id}"
    return validate_owner_id(owner)


def task_token(owner_id: str, task_id: str) -> str:
    """The holder token of a task's grant: ``<owner>|task:<task id>``.

    The request id part names the task, so whoever holds the grant (the task
    owner, or the process that adopted it, which keeps the request id) can
    be traced back to the task: see :func:`task_id_of_token`.
    """
    return f"{owner_id}|{TASK_OWNER_PREFIX}{task_id}"


#: A grant's mode letter in a lock hash, by name.
MODE_NAMES = {"x": "exclusive", "s": "shared", "l": "limited"}


def owner_of_token(token: str) -> str:
    """The owner id of a holder token ``<owner>|<request id>``."""
    return token.split("|", 1)[0]


def parse_grant(value: str) -> tuple[str, int | None]:
    """A lock hash value ``'<mode><fence>'`` (e.g. ``'x1764456000123456'``;
    a slot of a limited resource adds ``':<limit>'``) as (mode letter,
    fencing token or None)."""
    try:
        return value[:1], int(value[1:].partition(":")[0])
    except ValueError:
        return value[:1], None


def grant_limit(value: str) -> int | None:
    """The limit a slot's request asked for, from its lock hash value
    (``'l1764456000123456:5'`` -> 5); None for any other grant."""
    _, sep, limit = value.partition(":")
    return int(limit) if sep and limit.isdigit() else None


def task_id_of_token(token: str) -> str | None:
    """The task id a holder token was granted for; None for any other grant."""
    _, sep, rid = token.partition("|")
    if sep and rid.startswith(TASK_OWNER_PREFIX):
        return rid[len(TASK_OWNER_PREFIX) :]
    return None


def registry_bucket(resource: str) -> str:
    """The registry bucket (``'0'`` .. ``'63'``) of a resource name, as
    ``_common.lua``'s ``reg_buckets`` computes it (from its SHA-1)."""
    return str(int(hashlib.sha1(resource.encode("utf-8")).hexdigest()[:2], 16) % 64)


def holder_record(token: str, info: str) -> str:
    """The registry value recording who holds grant ``token``.

    ``<request id>\n<info>``, where ``info`` is ``task name\ntask id\nnode``.
    The request id (the token after ``|``) ties the record to this one grant:
    an owner holding a resource through two tokens has one registry field.
    """
    return f"{token.partition('|')[2]}\n{info}"


def holder_info_of(record: str, token: str) -> str | None:
    """The ``task name\ntask id\nnode`` part of a registry value if it is
    grant ``token``'s holder record (see :func:`holder_record`); else None
    (``''``, a plain lock, or another grant of the same owner)."""
    rid, sep, info = record.partition("\n")
    if not sep or rid != token.partition("|")[2]:
        return None
    return info


def new_owner_id() -> str:
    """A fresh owner id: ``<pid>-<11 characters>``; never contains ``|``.

    The tail is 64 random bits in URL-safe base 64 (letters, digits, ``-``,
    ``_``): as unique as 16 hex digits, in 5 fewer bytes of every key and
    holder token that names the owner.
    """
    return f"{os.getpid()}-{secrets.token_urlsafe(8)}"


#: Request ids of this process: one counter for every owner and thread
#: (``next()`` on an ``itertools.count`` is atomic under the GIL). A fork
#: copies it, which is harmless: the child's owner id is fresh, and a token
#: is only unique together with its owner id.
_request_ids = itertools.count(1)


def new_request_id() -> str:
    """A request id unique within this process: a counter, in hex.

    A holder token is ``<owner id>|<request id>``; owner ids are never
    reused, so a per-process counter keeps tokens unique (a token made
    under one identity and re-issued under a new one keeps its number,
    which the new identity's counter never hands out again). A few hex
    digits instead of a 32-digit UUID keep a held lock's Redis memory
    small: the token is stored in the lock hash.
    """
    return format(next(_request_ids), "x")


def owner_description(pid: int, name: str | None) -> str:
    """Value of an owner's liveness key: who the owner is, for operators."""
    label = f" name={name}" if name else ""
    return f"pid={pid} host={socket.gethostname()}{label}"


def validate_node_name(name: object, setting: str = "nodename") -> str:
    """Return a Celery node name (``celery@host``) usable in ``{ns}:node:<name>``.

    The rules of resource names apply (non-empty ``str``, at most
    :data:`MAX_RESOURCE_BYTES` UTF-8 bytes, no control characters); a
    refused name raises :class:`ConfigurationError` naming ``setting``.
    """
    try:
        return validate_resource(name)
    except InvalidResource as exc:
        raise ConfigurationError(setting, str(exc).replace("resource name", "node name")) from exc


class Keyspace:
    """Builds every key of one namespace."""

    def __init__(self, namespace: str) -> None:
        self.namespace = validate_namespace(namespace)
        #: Prefix of every key, hash tag included: ``{ns}:``.
        self.prefix = "{" + namespace + "}:"
        self.owners = self.prefix + "owners"
        self.fence = self.prefix + "fence"
        self.born = self.prefix + "born"
        self.seq = self.prefix + "seq"
        self.format = self.prefix + "format"
        #: Deferred tasks (``celery_redislock.worker.defer``): task id -> next
        #: re-attempt; task id -> park or grant deadline (ms, Redis TIME);
        #: task ids to dispatch.
        self.deferred = self.prefix + "deferred"
        self.deadlines = self.prefix + "deadlines"
        self.dispatch = self.prefix + "dispatch"
        #: The next free time in the guards' schedule (ms, Redis TIME;
        #: ``defer_guard.lua``, docs/defer-internals.md, "The guards' budget").
        self.guardslot = self.prefix + "guardslot"
        #: The deferred tasks' dispatchers (incarnation -> last beat).
        self.dispatchers = self.prefix + "dispatchers"

    def lock(self, resource: str) -> str:
        return f"{self.prefix}lock:{resource}"

    def queue(self, resource: str) -> str:
        return f"{self.prefix}q:{resource}"

    def held(self, owner_id: str) -> str:
        return f"{self.prefix}held:{owner_id}"

    def held_index(self, owner_id: str) -> str:
        """The bucket index of an owner's registry (exists once it spilled)."""
        return f"{self.prefix}held:{owner_id}|"

    def held_bucket(self, owner_id: str, bucket: str) -> str:
        """One bucket of an owner's spilled registry."""
        return f"{self.prefix}held:{owner_id}|{bucket}"

    def alive(self, owner_id: str) -> str:
        return f"{self.prefix}alive:{owner_id}"

    def req(self, token: str) -> str:
        return f"{self.prefix}req:{token}"

    def wake(self, token: str) -> str:
        return f"{self.prefix}wake:{token}"

    def waits(self, owner_id: str) -> str:
        return f"{self.prefix}waits:{owner_id}"

    def contended(self, resource: str) -> str:
        return f"{self.prefix}contended:{resource}"

    def lost(self, owner_id: str) -> str:
        return f"{self.prefix}lost:{owner_id}"

    def dead(self, owner_id: str) -> str:
        return f"{self.prefix}dead:{owner_id}"

    def holder(self, token: str) -> str:
        return f"{self.prefix}holder:{token}"

    def adopted(self, owner_id: str) -> str:
        return f"{self.prefix}adopted:{owner_id}"

    def dispatcher(self, incarnation: str) -> str:
        """``{ns}:dispatcher:<inc>``: one incarnation's dispatcher liveness."""
        return f"{self.prefix}dispatcher:{incarnation}"

    def defer_record(self, task_id: str) -> str:
        """``{ns}:defer:<task id>``: a deferred task's park record."""
        return f"{self.prefix}defer:{task_id}"

    def node(self, nodename: str) -> str:
        """``{ns}:node:<nodename>``: a worker node's record."""
        return node_key(self.prefix, nodename)

    def group(self, incarnation: str) -> str:
        """``{ns}:group:<inc>``: the owners of one worker incarnation."""
        return group_key(self.prefix, incarnation)

    def tomb(self, incarnation: str) -> str:
        """``{ns}:tomb:<inc>``: set when a successor evicted that incarnation."""
        return tomb_key(self.prefix, incarnation)

    def halt(self, incarnation: str) -> str:
        """``{ns}:halt:<inc>``: pushed when that incarnation begins shutting down."""
        return halt_key(self.prefix, incarnation)

    def resource_of(self, lock_key: str) -> str:
        """The resource name of a ``{ns}:lock:<resource>`` key."""
        head = self.prefix + "lock:"
        if not lock_key.startswith(head):
            raise ValueError(f"not a lock key of namespace {self.namespace!r}: {lock_key!r}")
        return lock_key[len(head) :]


# -- a worker node's keys (celery_redislock.node) ---------------------------


def node_key(prefix: str, nodename: str) -> str:
    """``{ns}:node:<nodename>``: the node record (hash)."""
    return f"{prefix}node:{nodename}"


def group_key(prefix: str, incarnation: str) -> str:
    """``{ns}:group:<inc>``: owner id -> process tag of one incarnation's owners.

    The value is ``identity.process_tag`` of the owner's process
    (``"<pid>.<starttime>"``), or a bare pid from an older registration.
    """
    return f"{prefix}group:{incarnation}"


def tomb_key(prefix: str, incarnation: str) -> str:
    """``{ns}:tomb:<inc>``: set when a successor evicted that incarnation."""
    return f"{prefix}tomb:{incarnation}"


def halt_key(prefix: str, incarnation: str) -> str:
    """``{ns}:halt:<inc>``: pushed when that incarnation begins shutting down.

    Its waiters block on it next to their wake list and leave the queue
    (:class:`~celery_redislock.exceptions.ShuttingDown`); each pushes the
    entry back for the next one.
    """
    return f"{prefix}halt:{incarnation}"
