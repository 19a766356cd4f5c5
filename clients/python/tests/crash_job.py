"""A job that dies between its two steps: it claims its key with
keep_request, records the checkpoint of step one, and kills itself (SIGKILL)
before step two, so that its key stays pending under a lease nobody renews.
Run by test_completer.py: python crash_job.py <key> <scope> <request JSON> <lease s>"""

import json
import os
import signal
import sys

import psycopg

from pg_idempotency import idempotent

key, scope, request, lease = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), float(sys.argv[4])
with psycopg.connect(autocommit=True) as conn:
    with idempotent(conn, key, scope=scope, request=request, lease=lease,
                    keep_request=True) as job:
        job.checkpoint("charged", {"charge": f"ch-{job.token}"})
        os.kill(os.getpid(), signal.SIGKILL)
