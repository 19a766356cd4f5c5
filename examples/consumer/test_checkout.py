"""Tests of checkout.py: a two-step job killed between its steps resumes in
the next worker from its checkpoint.

Run by test.sh (python3 -m unittest -v test_checkout).  Every test uses order
ids of its own.  A worker is killed with SIGKILL where it says it paused (it
blocks on its stdin there), never after a guessed delay; the next worker is
started once the killed worker's database sessions are gone, or (lease mode)
waits in its claim for the lease to end.

What the tests prove: whichever point the worker dies at, each order ends
with exactly one payment and exactly one shipment that refers to it; a
worker killed after the charge is taken over (attempt 2) by a worker that
sees the phase 'charge_created' and does not charge again; a worker killed
inside the charge's transaction leaves neither the payment nor its
checkpoint, and the next attempt charges.
"""

import os
import signal
import subprocess
import sys
import time
import unittest
import uuid

import psycopg

HERE = os.path.dirname(os.path.abspath(__file__))
CHECKOUT = os.path.join(HERE, 'checkout.py')
APP_ROLE = '-c role=ledger_consumer'
SCOPE = 'checkout'


class Worker:
    """A checkout.py process; stdin stays open so that a pause blocks."""

    def __init__(self, name, order, *extra):
        self.name = name
        self.popen = subprocess.Popen(
            [sys.executable, CHECKOUT, '--name', name, '--order', order['order'],
             '--account', order['account'], '--amount', str(order['amount']), *extra],
            env=dict(os.environ, PGOPTIONS=APP_ROLE), stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.output = []

    def read_until(self, needle):
        """Read output lines until one contains needle (the worker blocks
        right after printing it); fail if the worker exits first."""
        for line in self.popen.stdout:
            self.output.append(line)
            if needle in line:
                return line
        raise AssertionError(f'{self.name} exited without printing {needle!r}: '
                             + ''.join(self.output))

    def finish(self, timeout=60):
        """Let a worker run to its end: its exit status and whole output."""
        out, _ = self.popen.communicate(timeout=timeout)
        self.output.append(out)
        return self.popen.returncode, ''.join(self.output)

    def kill(self):
        if self.popen.poll() is None:
            self.popen.kill()
        self.popen.wait()
        for f in (self.popen.stdin, self.popen.stdout):
            f.close()


class CheckoutTest(unittest.TestCase):
    maxDiff = None

    def setUp(self):
        self.db = psycopg.connect(autocommit=True)
        self.run_id = uuid.uuid4().hex[:8]
        self.workers = []

    def tearDown(self):
        for w in self.workers:
            w.kill()
        self.db.close()

    # ---- helpers ------------------------------------------------------------

    def order(self, name):
        return {'order': f'{self.run_id}-{name}', 'account': 'acct-1', 'amount': 1250}

    def worker(self, name, order, *extra):
        w = Worker(f'{self.run_id}-{name}', order, *extra)
        self.workers.append(w)
        return w

    def rows(self, sql, *params):
        return [tuple(r) for r in self.db.execute(sql, params)]

    def payments(self, order):
        return self.rows('SELECT payment_id, attempt FROM payments WHERE order_id = %s '
                         'ORDER BY payment_id', order['order'])

    def only_payment(self, order, attempt):
        """The id of the order's one payment, made by attempt `attempt`."""
        payments = self.payments(order)
        self.assertEqual([a for _, a in payments], [attempt], payments)
        return payments[0][0]

    def shipments(self, order):
        return self.rows('SELECT payment_id, attempt FROM shipments WHERE order_id = %s '
                         'ORDER BY shipment_id', order['order'])

    def key(self, order):
        """(status, attempt, phase, phase_data, response_body, bound) of the order's key."""
        row = self.db.execute(
            'SELECT status, attempt, phase, phase_data, response_body, '
            'owner_session IS NOT NULL FROM idempotency.keys WHERE key = %s AND scope = %s',
            (f'order-{order["order"]}', SCOPE)).fetchone()
        return tuple(row) if row is not None else None

    def kill_and_wait_for_its_sessions(self, w):
        """SIGKILL the worker, then wait until the server has ended its sessions."""
        w.popen.send_signal(signal.SIGKILL)
        self.assertEqual(w.popen.wait(), -signal.SIGKILL)
        deadline = time.monotonic() + 30
        while self.db.execute('SELECT count(*) FROM pg_stat_activity WHERE application_name = %s',
                              (f'checkout {w.name}',)).fetchone()[0]:
            self.assertLess(time.monotonic(), deadline, 'the killed worker\'s session lingers')
            time.sleep(0.02)

    def assert_done_once(self, order, payment_attempt):
        """One payment (by payment_attempt), one shipment of that payment
        (by attempt 2), the result stored by attempt 2."""
        payment_id = self.only_payment(order, payment_attempt)      # charged exactly once
        self.assertEqual(self.shipments(order), [(payment_id, 2)], 'shipped exactly once')
        status, attempt, _, _, body, _ = self.key(order)
        self.assertEqual((status, attempt), ('succeeded', 2))
        self.assertEqual(body['json']['payment_id'], payment_id)
        return payment_id

    # ---- tests ----------------------------------------------------------------

    def test_runs_both_steps_once_and_replays(self):
        order = self.order('plain')
        code, out = self.worker('A', order).finish()
        self.assertEqual(code, 0, out)
        self.assertIn('attempt 1, phase None', out)
        payment_id = self.only_payment(order, attempt=1)
        self.assertEqual(self.shipments(order), [(payment_id, 1)])
        self.assertEqual(self.key(order)[:3], ('succeeded', 1, 'charge_created'))

        code, out = self.worker('B', order).finish()
        self.assertEqual(code, 0, out)
        self.assertIn('already done', out)
        self.assertEqual(len(self.payments(order)), 1)
        self.assertEqual(len(self.shipments(order)), 1)

    def test_killed_after_the_charge_session_bound_successor_resumes_at_once(self):
        order = self.order('bound')
        a = self.worker('A', order, '--session-bound', '--lease', '1 hour', '--pause-at', 'charged')
        a.read_until('PAUSED charged')
        payment_id = self.only_payment(order, attempt=1)
        self.assertEqual(self.shipments(order), [])
        self.assertEqual(self.key(order)[:4] + self.key(order)[5:],
                         ('pending', 1, 'charge_created', {'payment_id': payment_id}, True))

        self.kill_and_wait_for_its_sessions(a)
        # the lease has an hour to run: only the ended session frees the key
        code, out = self.worker('B', order, '--session-bound', '--lease', '1 hour').finish()
        self.assertEqual(code, 0, out)
        self.assertIn('attempt 2, phase charge_created', out)
        self.assertIn(f'resuming after charge_created: payment {payment_id}', out)
        self.assertNotIn('charged', out)
        self.assertEqual(self.assert_done_once(order, payment_attempt=1), payment_id)
        self.assertEqual(self.key(order)[2], 'charge_created', 'the finish keeps the phase')

    def test_killed_after_the_charge_successor_takes_over_after_the_lease(self):
        order = self.order('lease')
        a = self.worker('A', order, '--lease', '2 seconds', '--pause-at', 'charged')
        a.read_until('PAUSED charged')
        payment_id = self.only_payment(order, attempt=1)
        self.assertEqual(self.key(order)[5], False, 'not session-bound')

        a.popen.send_signal(signal.SIGKILL)
        self.assertEqual(a.popen.wait(), -signal.SIGKILL)
        # the claim waits for the lease to end (no heartbeat renews it now)
        code, out = self.worker('B', order, '--lease', '2 seconds', '--wait', '60').finish()
        self.assertEqual(code, 0, out)
        self.assertIn('attempt 2, phase charge_created', out)
        self.assertIn(f'resuming after charge_created: payment {payment_id}', out)
        self.assertEqual(self.assert_done_once(order, payment_attempt=1), payment_id)

    def test_killed_inside_the_charge_transaction_the_successor_charges(self):
        order = self.order('charging')
        a = self.worker('A', order, '--session-bound', '--lease', '1 hour',
                        '--pause-at', 'charging')
        a.read_until('PAUSED charging')
        self.assertEqual(self.payments(order), [], 'not committed yet')
        self.assertEqual(self.key(order)[:4], ('pending', 1, None, None))

        self.kill_and_wait_for_its_sessions(a)
        self.assertEqual(self.payments(order), [])
        self.assertEqual(self.key(order)[2:4], (None, None), 'no checkpoint without its payment')
        code, out = self.worker('B', order, '--session-bound').finish()
        self.assertEqual(code, 0, out)
        self.assertIn('attempt 2, phase None', out)
        self.assertIn('charged', out)
        self.assert_done_once(order, payment_attempt=2)

    def test_a_live_worker_holds_the_order(self):
        order = self.order('busy')
        a = self.worker('A', order, '--session-bound', '--pause-at', 'charged')
        a.read_until('PAUSED charged')
        code, out = self.worker('B', order, '--session-bound').finish()
        self.assertEqual(code, 75, out)
        self.assertIn('in progress elsewhere', out)
        # A goes on when told to: it ships, once
        a.popen.stdin.write('go\n')
        a.popen.stdin.flush()
        code, out = a.finish()
        self.assertEqual(code, 0, out)
        payment_id = self.only_payment(order, attempt=1)
        self.assertEqual(self.shipments(order), [(payment_id, 1)])
        self.assertEqual(self.key(order)[:2], ('succeeded', 1))


if __name__ == '__main__':
    unittest.main()
