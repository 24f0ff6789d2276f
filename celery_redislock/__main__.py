"""``python -m celery_redislock --url redis://... [--namespace ns] <command>``.

The operator CLI without a Celery app: the same commands as
``celery -A proj redislock`` (status, locks, owners, waiters, release,
reconcile); ``--url`` (or ``REDISLOCK_URL``) is required here since there
are no app settings to read it from.
"""

from .integration.cli import main

if __name__ == "__main__":
    main()
