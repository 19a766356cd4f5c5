#!/usr/bin/env python3
"""consumer.py: a queue consumer that books each message exactly once, with the
pg_idempotency package (clients/python).

The queue (table `queue`, see schema.sql) delivers at least once: a message
can arrive twice because the producer published it twice, because a consumer
died before acknowledging it, or because its visibility timeout ran out.  The
consumer runs each message in `idempotent(db, message_id, request=payload,
scope='ledger')` and maps what it answers like this:

    the block runs       book it (the result is stored), acknowledge
    job.replayed, or     already settled (succeeded or failed):
    StoredFailureError   acknowledge, do nothing
    InProgressError      another consumer holds it: leave it, visible again
                         after retry_after seconds (redelivery)
    MismatchError        same id, different payload (a producer bug):
                         dead-letter, acknowledge

Failures while booking:

    terminal     (invalid message) job.fail(): stored with status 'failed' and
                 acknowledged; every later copy replays the failure
    retryable    (a dependency is down) raised out of the block, which releases
                 the claim; the message is left for redelivery and the next
                 delivery is a fresh first attempt

Two modes (--mode):

    tx     `with db.transaction():` around the block: claim, booking and
           finish commit together.  A crash rolls the claim back with the
           booking: the next delivery starts over.  A retryable failure is a
           ROLLBACK, which leaves no trace of the claim.
    lease  the claim commits on its own with a lease (a heartbeat renews it
           while the work runs), then the booking and the finish commit
           together (job.finish(entry, conn=db) in one transaction).  A crash
           leaves a pending key; one lease after its last heartbeat the next
           delivery takes it over (attempt + 1).  This is the shape to use
           when the work is long or leaves the database.

In both modes the ledger row commits in the same transaction as the one
idem_finish that succeeds for the key, so each message is booked exactly once
as long as its key is retained (idempotency.retention: keep it longer than the
oldest redelivery your queue can produce).  The *work* can start more than
once (work_log shows it); only what commits with the finish is exactly once.

Acknowledging is a separate statement on a separate connection, as it would be
with an external broker.  A crash between commit and ack just means one more
delivery, which answers `replay` and is acknowledged.

Usage: PGDATABASE=... ./consumer.py --name A [--mode tx|lease] [--once]
       [--exit-when-empty] [--visibility 30] [--lease '30 seconds'] [--exit-with-parent]

Needs clients/python/src on PYTHONPATH, or the pg-idempotency wheel installed.
"""

import argparse
import contextlib
import json
import os
import signal
import sys
import time

import psycopg

from pg_idempotency import (InProgressError, KeyLostError, MismatchError, StoredFailureError,
                            idempotent)

SCOPE = 'ledger'


class TerminalError(Exception):
    """The message can never succeed: store the failure."""


class RetryableError(Exception):
    """The message may succeed later: release it for redelivery."""


class Delivery:
    def __init__(self, delivery_id, message_id, payload_text, receive_count):
        self.delivery_id = delivery_id
        self.message_id = message_id
        self.payload_text = payload_text     # the jsonb text, as published
        self.payload = json.loads(payload_text)
        self.receive_count = receive_count


class Consumer:
    def __init__(self, name, mode, visibility, lease, retry_delay):
        self.name = name
        self.mode = mode
        self.visibility = visibility
        self.retry_delay = retry_delay
        self.stopping = False
        self.parent = None              # set by --exit-with-parent
        # The queue connection stands in for a broker; the database connection
        # does the idempotent work.  Both autocommit: every transaction is explicit.
        self.queue = psycopg.connect(autocommit=True)
        self.db = psycopg.connect(autocommit=True)
        # the lease as PostgreSQL reads it ('30 seconds', '1 min', '2')
        self.lease = self.db.execute(
            "SELECT extract(epoch FROM %s::interval)::float8", (lease,)).fetchone()[0]

    def sleep(self, seconds):
        """time.sleep, but exit at once if our parent is gone (--exit-with-parent)."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if self.parent is not None and os.getppid() != self.parent:
                sys.exit('consumer: parent process gone, exiting')
            time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))

    def say(self, text):
        print(f'{self.name}: {text}', flush=True)

    # ---- the queue ------------------------------------------------------

    def receive(self):
        """The oldest visible message, made invisible for `visibility` seconds."""
        row = self.queue.execute(
            """
            UPDATE queue
               SET visible_at = clock_timestamp() + make_interval(secs => %s),
                   receive_count = receive_count + 1
             WHERE delivery_id = (SELECT delivery_id FROM queue
                                   WHERE visible_at <= clock_timestamp()
                                   ORDER BY visible_at, delivery_id
                                   LIMIT 1
                                     FOR UPDATE SKIP LOCKED)
            RETURNING delivery_id, message_id, payload::text, receive_count
            """, (self.visibility,)).fetchone()
        if row is None:
            return None
        delivery = Delivery(*row)
        self.log(delivery, 'received')
        return delivery

    def ack(self, d):
        self.queue.execute('DELETE FROM queue WHERE delivery_id = %s', (d.delivery_id,))

    def redeliver_after(self, d, seconds):
        """Leave the message; it becomes visible again after `seconds`."""
        self.queue.execute(
            """UPDATE queue SET visible_at = clock_timestamp() + make_interval(secs => %s)
                WHERE delivery_id = %s""", (seconds, d.delivery_id))

    def queue_is_empty(self):
        return self.queue.execute('SELECT NOT EXISTS (SELECT FROM queue)').fetchone()[0]

    def log(self, d, event):
        self.queue.execute(
            'INSERT INTO delivery_log (delivery_id, message_id, consumer, event) '
            'VALUES (%s, %s, %s, %s)', (d.delivery_id, d.message_id, self.name, event))

    def dead_letter(self, d, reason):
        self.queue.execute(
            'INSERT INTO dead_letters (delivery_id, message_id, payload, reason) '
            'VALUES (%s, %s, %s::jsonb, %s)',
            (d.delivery_id, d.message_id, d.payload_text, reason))

    # ---- the work -------------------------------------------------------

    def start_work(self, d, attempt, token):
        """Record that the work starts; returns how many times it has started."""
        self.queue.execute(
            'INSERT INTO work_log (message_id, consumer, attempt, token) VALUES (%s, %s, %s, %s)',
            (d.message_id, self.name, attempt, token))
        self.say(f'working on {d.message_id} attempt {attempt} token {token}')
        return self.queue.execute('SELECT count(*) FROM work_log WHERE message_id = %s',
                                  (d.message_id,)).fetchone()[0]

    def check(self, d, starts):
        """Validate the message and simulate its dependencies (for the tests)."""
        p = d.payload
        if p.get('slow_first') and starts == 1:
            self.say(f'SLOW {d.message_id}')     # the test kills us here
            self.sleep(120)
        if starts <= p.get('transient_failures', 0):
            raise RetryableError('the account service is unavailable')
        if not isinstance(p.get('account'), str) or not p['account']:
            raise TerminalError('"account" must be a non-empty string')
        if not isinstance(p.get('amount'), int) or p['amount'] <= 0:
            raise TerminalError('"amount" must be a positive integer')

    def book(self, d):
        """The side effect: one ledger row, in the caller's open transaction."""
        entry_id = self.db.execute(
            'INSERT INTO ledger (message_id, account, amount, consumer) '
            'VALUES (%s, %s, %s, %s) RETURNING entry_id',
            (d.message_id, d.payload['account'], d.payload['amount'], self.name)).fetchone()[0]
        return {'entry_id': entry_id}

    # ---- one delivery -----------------------------------------------------

    def work(self, d, job):
        """The claimed block: 'succeeded' or 'failed'; RetryableError escapes."""
        starts = self.start_work(d, job.attempt, job.token)
        try:
            self.check(d, starts)
        except TerminalError as e:
            job.fail(e)                 # stored at the end of the block, replayed to every copy
            return 'failed'
        # the booking commits if and only if the finish does (in tx mode this
        # is a savepoint of the one transaction)
        with self.db.transaction():
            job.finish(self.book(d), conn=self.db)
        return 'succeeded'

    def handle(self, d):
        # tx mode: the claim, the booking and the stored result commit together
        tx = self.db.transaction() if self.mode == 'tx' else contextlib.nullcontext()
        try:
            with tx:
                with idempotent(self.db, d.message_id, request=d.payload, scope=SCOPE,
                                lease=self.lease) as job:
                    event = 'replay' if job.replayed else self.work(d, job)
        except StoredFailureError:
            event = 'replay'            # settled as failed earlier
        except InProgressError as e:
            self.redeliver_after(d, e.retry_after)
            self.log(d, 'in_progress')
            return
        except MismatchError:
            self.dead_letter(d, 'message id reused with a different payload')
            event = 'mismatch'
        except RetryableError as e:
            # released: the next delivery is a fresh first attempt
            self.say(f'{d.message_id}: {e}; released for redelivery')
            self.redeliver_after(d, self.retry_delay)
            self.log(d, 'released')
            return
        except KeyLostError as e:
            # Too slow: another consumer took the key over.  Our booking rolled
            # back with the failed finish; the message stays for redelivery.
            self.say(f'{d.message_id}: lost the claim ({e.sqlstate})')
            self.log(d, 'lost')
            return
        self.ack(d)
        self.log(d, event)

    def run(self, once=False, exit_when_empty=False):
        while not self.stopping:
            d = self.receive()
            if d is None:
                if exit_when_empty and self.queue_is_empty():
                    break
                self.sleep(0.05)
                continue
            try:
                self.handle(d)
            except psycopg.OperationalError:
                raise                   # the connection is gone: exit, restart us
            except Exception as e:      # a bug: leave the message for redelivery
                self.say(f'{d.message_id}: unexpected {e!r}; left for redelivery')
            if once:
                break
        self.say('done')


def main():
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--name', default='consumer')
    ap.add_argument('--mode', choices=['tx', 'lease'], default='tx')
    ap.add_argument('--visibility', type=float, default=30.0,
                    help='seconds a received message stays invisible')
    ap.add_argument('--lease', default='30 seconds', help='claim lease (lease mode)')
    ap.add_argument('--retry-delay', type=float, default=0.2,
                    help='seconds before a released message is redelivered')
    ap.add_argument('--once', action='store_true', help='handle one delivery, then exit')
    ap.add_argument('--exit-when-empty', action='store_true',
                    help='exit once the queue holds no message at all')
    ap.add_argument('--exit-with-parent', action='store_true',
                    help='exit when the parent process is gone (test harnesses)')
    args = ap.parse_args()

    consumer = Consumer(args.name, args.mode, args.visibility, args.lease, args.retry_delay)
    if args.exit_with_parent:
        consumer.parent = os.getppid()

    def stop(signum, frame):
        consumer.stopping = True     # finish the current message, then exit
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)

    consumer.run(once=args.once, exit_when_empty=args.exit_when_empty)


if __name__ == '__main__':
    sys.exit(main())
