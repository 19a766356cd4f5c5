#!/usr/bin/env python3
"""consumer.py: a queue consumer that books each message exactly once.

The queue (table `queue`, see schema.sql) delivers at least once: a message
can arrive twice because the producer published it twice, because a consumer
died before acknowledging it, or because its visibility timeout ran out.  The
consumer uses the message id as the idempotency key (scope 'ledger') and maps
the claim outcomes like this:

    claimed      book it, finish, acknowledge
    replay       already settled (succeeded or failed): acknowledge, do nothing
    in_progress  another consumer holds it: leave it, visible again after
                 retry_after seconds (redelivery)
    mismatch     same id, different payload (a producer bug): dead-letter, ack

Failures while booking:

    terminal     (invalid message) stored with status 'failed' and acknowledged;
                 every later copy replays the failure
    retryable    (a dependency is down) the claim is released and the message
                 left for redelivery; the next delivery is a fresh first attempt

Two modes (--mode):

    tx     BEGIN; idem_claim; INSERT INTO ledger; idem_finish; COMMIT.
           A crash rolls the claim back with the booking: the next delivery
           starts over.  A retryable failure is a ROLLBACK, which leaves no
           trace of the claim (the same as idem_release).
    lease  idem_claim commits on its own with a lease, then the booking and
           idem_finish commit together.  A crash leaves a pending key; after
           its lease the next delivery takes it over (attempt + 1).  This is
           the shape to use when the work is long or leaves the database.

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
"""

import argparse
import json
import os
import signal
import sys
import time

import psycopg
from psycopg.types.json import Jsonb

SCOPE = 'ledger'

# SQLSTATEs meaning "this attempt no longer owns the key": a dead token
# (taken over or reset), finished by another token, or gone.
LOST_CLAIM = {'55006', '55000', 'P0002'}


class TerminalError(Exception):
    """The message can never succeed: store the failure."""


class RetryableError(Exception):
    """The message may succeed later: release it for redelivery."""


class Delivery:
    def __init__(self, delivery_id, message_id, payload_text, receive_count):
        self.delivery_id = delivery_id
        self.message_id = message_id
        self.payload_text = payload_text     # the jsonb text: the fingerprint's input
        self.payload = json.loads(payload_text)
        self.receive_count = receive_count


class Consumer:
    def __init__(self, name, mode, visibility, lease, retry_delay):
        self.name = name
        self.mode = mode
        self.visibility = visibility
        self.lease = lease
        self.retry_delay = retry_delay
        self.stopping = False
        self.parent = None              # set by --exit-with-parent
        # The queue connection stands in for a broker; the database connection
        # does the idempotent work.  Both autocommit: every transaction is explicit.
        self.queue = psycopg.connect(autocommit=True)
        self.db = psycopg.connect(autocommit=True)

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

    # ---- the extension ----------------------------------------------------

    def claim(self, d):
        return self.db.execute(
            """SELECT outcome, token, attempt, status, retry_after
                 FROM idempotency.idem_claim(key => %s, request => %s::jsonb,
                                             scope => %s, lease => %s::interval)""",
            (d.message_id, d.payload_text, SCOPE, self.lease)).fetchone()

    def finish(self, d, token, status, body):
        self.db.execute(
            """SELECT idempotency.idem_finish(key => %s, token => %s, response_body => %s,
                                              scope => %s, status => %s)""",
            (d.message_id, token, Jsonb(body), SCOPE, status))

    def release(self, d, token):
        self.db.execute('SELECT idempotency.idem_release(key => %s, token => %s, scope => %s)',
                        (d.message_id, token, SCOPE))

    # ---- one delivery -----------------------------------------------------

    def answer_outcome(self, d, outcome, retry_after):
        """Handle every outcome but 'claimed'."""
        if outcome == 'replay':
            self.ack(d)
        elif outcome == 'in_progress':
            self.redeliver_after(d, retry_after)
        elif outcome == 'mismatch':
            self.dead_letter(d, 'message id reused with a different payload')
            self.ack(d)
        else:
            raise RuntimeError(f'unexpected claim outcome {outcome}')
        self.log(d, outcome)

    def handle_tx(self, d):
        """BEGIN; claim; book; finish; COMMIT: all or nothing."""
        try:
            with self.db.transaction():
                outcome, token, attempt, _, retry_after = self.claim(d)
                if outcome != 'claimed':
                    raise psycopg.Rollback()
                starts = self.start_work(d, attempt, token)
                try:
                    self.check(d, starts)
                    status, body = 'succeeded', self.book(d)
                except TerminalError as e:
                    status, body = 'failed', {'error': str(e)}
                self.finish(d, token, status, body)
        except RetryableError as e:
            # the rollback took the claim with it: no trace, fresh attempt next time
            self.say(f'{d.message_id}: {e}; rolled back for redelivery')
            self.redeliver_after(d, self.retry_delay)
            self.log(d, 'released')
            return
        if outcome != 'claimed':
            self.answer_outcome(d, outcome, retry_after)
            return
        self.ack(d)
        self.log(d, status)

    def handle_lease(self, d):
        """claim (commits, with a lease); then book + finish in one transaction."""
        outcome, token, attempt, _, retry_after = self.claim(d)
        if outcome != 'claimed':
            self.answer_outcome(d, outcome, retry_after)
            return
        starts = self.start_work(d, attempt, token)
        try:
            event = self.work_under_lease(d, token, starts)
        except psycopg.Error as e:
            if e.sqlstate not in LOST_CLAIM:
                raise
            # Too slow: another consumer took the key over.  Our booking rolled
            # back with the failed finish; the message stays for redelivery.
            self.say(f'{d.message_id}: lost the claim ({e.sqlstate})')
            self.log(d, 'lost')
            return
        if event == 'released':
            self.redeliver_after(d, self.retry_delay)
        else:
            self.ack(d)
        self.log(d, event)

    def work_under_lease(self, d, token, starts):
        try:
            self.check(d, starts)
        except RetryableError as e:
            self.say(f'{d.message_id}: {e}; released for redelivery')
            self.release(d, token)      # the next claim is a fresh first attempt
            return 'released'
        except TerminalError as e:
            self.finish(d, token, 'failed', {'error': str(e)})
            return 'failed'
        # the booking commits if and only if the finish does
        with self.db.transaction():
            body = self.book(d)
            self.finish(d, token, 'succeeded', body)
        return 'succeeded'

    def run(self, once=False, exit_when_empty=False):
        handle = self.handle_tx if self.mode == 'tx' else self.handle_lease
        while not self.stopping:
            d = self.receive()
            if d is None:
                if exit_when_empty and self.queue_is_empty():
                    break
                self.sleep(0.05)
                continue
            try:
                handle(d)
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
