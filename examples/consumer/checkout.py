#!/usr/bin/env python3
"""checkout.py: a two-step job that resumes where a crashed attempt stopped,
with the pg_idempotency package (clients/python).

Checking out an order takes two steps, each a transaction in this database:

    1. charge   a row in `payments`; committed together with the checkpoint
                'charge_created' that records the payment's id
    2. ship     a row in `shipments`; committed together with the stored
                result (job.finish)

The job runs in `idempotent(db, 'order-<id>', request=order, scope='checkout')`.
If the worker dies after step 1, the key stays pending.  The next worker that
runs the order takes the key over (attempt 2) and finds the checkpoint in
job.phase / job.phase_data: it skips the charge and ships with the recorded
payment id.  If it dies inside step 1 (before the commit), the payment row and
its checkpoint roll back together, and the next attempt charges.  So each
order gets exactly one payment and one shipment, whatever crashes.

When does the next worker get the key?

    --session-bound   at once: the claim is tied to this worker's database
                      session, which ends when the worker dies
    (default)         when the lease ends, one lease after the last heartbeat;
                      --wait lets the claim wait for that instead of failing
                      with "in progress"

Usage: PGDATABASE=... ./checkout.py --order o-1 --account acct-1 --amount 1250
       [--name A] [--session-bound] [--lease '30 seconds'] [--wait 0]
       [--pause-at charging|charged]

--pause-at (for the tests): print "PAUSED <point>" and block until a line
arrives on stdin; the test kills the worker there.  "charging" is inside the
step-1 transaction, after the payment INSERT and before its commit;
"charged" is after step 1 committed, before step 2.

Exit status: 0 done (or done before), 75 another worker holds the order.
Needs clients/python/src on PYTHONPATH, or the pg-idempotency wheel installed.
"""

import argparse
import sys

import psycopg

from pg_idempotency import InProgressError, idempotent

SCOPE = 'checkout'
EX_TEMPFAIL = 75


class Worker:
    def __init__(self, name, lease, wait, session_bound, pause_at):
        self.name = name
        self.wait = wait
        self.session_bound = session_bound
        self.pause_at = pause_at
        # One autocommit connection: the claim commits on its own, each step
        # is an explicit transaction.  With --session-bound the key is tied to
        # this connection's session.  The application name lets a test see
        # when the session has ended.
        self.db = psycopg.connect(autocommit=True, application_name=f'checkout {name}')
        self.lease = self.db.execute(
            "SELECT extract(epoch FROM %s::interval)::float8", (lease,)).fetchone()[0]

    def say(self, text):
        print(f'{self.name}: {text}', flush=True)

    def pause(self, point):
        if self.pause_at == point:
            self.say(f'PAUSED {point}')
            sys.stdin.readline()

    def charge(self, order, job):
        """Step 1: the payment and the checkpoint that records it, in one transaction."""
        with self.db.transaction():
            payment_id = self.db.execute(
                'INSERT INTO payments (order_id, account, amount, worker, attempt) '
                'VALUES (%s, %s, %s, %s, %s) RETURNING payment_id',
                (order['order'], order['account'], order['amount'], self.name,
                 job.attempt)).fetchone()[0]
            self.pause('charging')
            job.checkpoint('charge_created', {'payment_id': payment_id}, conn=self.db)
        self.say(f'charged {order["order"]}: payment {payment_id}')
        return payment_id

    def ship(self, order, job, payment_id):
        """Step 2: the shipment, committed with the stored result."""
        with self.db.transaction():
            shipment_id = self.db.execute(
                'INSERT INTO shipments (order_id, payment_id, worker, attempt) '
                'VALUES (%s, %s, %s, %s) RETURNING shipment_id',
                (order['order'], payment_id, self.name, job.attempt)).fetchone()[0]
            job.finish({'payment_id': payment_id, 'shipment_id': shipment_id}, conn=self.db)
        self.say(f'shipped {order["order"]}: shipment {shipment_id}')

    def checkout(self, order):
        with idempotent(self.db, f'order-{order["order"]}', request=order, scope=SCOPE,
                        lease=self.lease, wait=self.wait,
                        session_bound=self.session_bound) as job:
            if job.replayed:
                self.say(f'already done: {job.value}')
                return
            self.say(f'attempt {job.attempt}, phase {job.phase}')
            if job.phase == 'charge_created':
                # an earlier attempt charged and died: do not charge again
                payment_id = job.phase_data['payment_id']
                self.say(f'resuming after charge_created: payment {payment_id}')
            else:
                payment_id = self.charge(order, job)
                self.pause('charged')
            self.ship(order, job, payment_id)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--order', required=True)
    ap.add_argument('--account', required=True)
    ap.add_argument('--amount', type=int, required=True)
    ap.add_argument('--name', default='worker')
    ap.add_argument('--lease', default='30 seconds', help='claim lease')
    ap.add_argument('--wait', type=float, default=0.0,
                    help='seconds to wait for another worker holding the order')
    ap.add_argument('--session-bound', action='store_true',
                    help='free the order at once if this worker dies')
    ap.add_argument('--pause-at', choices=['charging', 'charged'],
                    help='block on stdin at that point (tests)')
    args = ap.parse_args()

    worker = Worker(args.name, args.lease, args.wait, args.session_bound, args.pause_at)
    order = {'order': args.order, 'account': args.account, 'amount': args.amount}
    try:
        worker.checkout(order)
    except InProgressError as e:
        worker.say(f'in progress elsewhere; retry after {e.retry_after} s')
        return EX_TEMPFAIL
    return 0


if __name__ == '__main__':
    sys.exit(main())
