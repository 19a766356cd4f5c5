"""Tests of consumer.py against a real database, with real consumer processes.

Run by test.sh (python3 -m unittest -v test_consumer).  Every test uses message
ids of its own, so keys never collide between tests.

What "exactly once" means here, and what these tests prove: each message's
ledger row commits at most once and, once the queue is drained, exactly once
for every message that can succeed, however many times the message was
delivered, whichever consumer died in the middle, and however many consumers
ran at once.  The ledger has no unique constraint on message_id, so a second
booking would be counted, not hidden.  The work itself may start more than
once (work_log); that is at-least-once, and the tests show it too.
"""

import os
import queue as queuelib
import random
import signal
import subprocess
import sys
import threading
import time
import unittest
import uuid

import psycopg
from psycopg.types.json import Jsonb

HERE = os.path.dirname(os.path.abspath(__file__))
CONSUMER = os.path.join(HERE, 'consumer.py')
APP_ROLE = '-c role=ledger_consumer'
LEASE = '2 seconds'
VISIBILITY = '3'
SCOPE = 'ledger'


def connect():
    return psycopg.connect(autocommit=True)


def failure(message):
    """A stored failure as pg_idempotency writes it (the Node library too)."""
    return {'v': 1, 'error': {'name': 'TerminalError', 'message': message}}


class Proc:
    """A consumer process; its output lines are collected by a thread."""

    def __init__(self, name, mode, *extra):
        env = dict(os.environ, PGOPTIONS=APP_ROLE)
        self.name = name
        self.popen = subprocess.Popen(
            [sys.executable, CONSUMER, '--name', name, '--mode', mode,
             '--visibility', VISIBILITY, '--lease', LEASE, '--exit-with-parent', *extra],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines = queuelib.Queue()
        self.output = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for line in self.popen.stdout:
            self.output.append(line)
            self.lines.put(line)

    def wait(self, timeout):
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            raise AssertionError(f'{self.name} did not finish: {"".join(self.output)}')

    def kill(self):
        if self.popen.poll() is None:
            self.popen.kill()
        self.popen.wait()
        self.reader.join(5)
        self.popen.stdout.close()


def wait_for_line(procs, needle, timeout):
    """The first process that prints a line containing needle, and the line."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for p in procs:
            try:
                line = p.lines.get(timeout=0.05)
            except queuelib.Empty:
                continue
            if needle in line:
                return p, line
    raise AssertionError(f'no consumer printed {needle!r}: ' +
                         ' | '.join(''.join(p.output) for p in procs))


class ConsumerTestCase(unittest.TestCase):
    maxDiff = None

    def setUp(self):
        self.db = connect()
        self.run_id = uuid.uuid4().hex[:8]
        self.procs = []

    def tearDown(self):
        for p in self.procs:
            p.kill()
        self.db.execute('DELETE FROM queue WHERE message_id LIKE %s', (self.run_id + '%',))
        self.db.close()

    # ---- helpers ----------------------------------------------------------

    def mid(self, name):
        return f'{self.run_id}-{name}'

    def publish(self, message_id, payload):
        self.db.execute('INSERT INTO queue (message_id, payload) VALUES (%s, %s)',
                        (message_id, Jsonb(payload)))

    def consumer(self, name, mode, *extra):
        p = Proc(f'{self.run_id}-{name}', mode, *extra)
        self.procs.append(p)
        return p

    def drain(self, mode, timeout=60):
        p = self.consumer('drain', mode, '--exit-when-empty')
        self.assertEqual(p.wait(timeout), 0, ''.join(p.output))

    def scalar(self, sql, *params):
        return self.db.execute(sql, params).fetchone()[0]

    def ledger_count(self, message_id):
        return self.scalar('SELECT count(*) FROM ledger WHERE message_id = %s', message_id)

    def events(self, message_id, event=None):
        if event is None:
            return [r[0] for r in self.db.execute(
                'SELECT event FROM delivery_log WHERE message_id = %s ORDER BY id',
                (message_id,))]
        return self.scalar('SELECT count(*) FROM delivery_log WHERE message_id = %s AND event = %s',
                           message_id, event)

    def work_starts(self, message_id):
        return self.scalar('SELECT count(*) FROM work_log WHERE message_id = %s', message_id)

    def lookup(self, message_id):
        cur = self.db.execute(
            'SELECT status, attempt, response_body FROM idempotency.idem_lookup(%s, %s)',
            (message_id, SCOPE))
        return cur.fetchone()

    def queued(self, message_id):
        return self.scalar('SELECT count(*) FROM queue WHERE message_id = %s', message_id)


class BothModes:
    """Every test below runs in tx mode and in lease mode (subclasses)."""
    mode = None

    def test_duplicates_crash_and_two_consumers_book_each_message_once(self):
        rng = random.Random(self.run_id)
        messages = {}
        for i in range(30):
            payload = {'account': f'acct-{i % 4}', 'amount': 100 + i}
            if i % 10 == 3:
                payload['amount'] = -5                  # terminal failure
            if i % 10 == 7:
                payload['transient_failures'] = 1       # retryable once
            if i == 0:
                payload['slow_first'] = True            # a consumer is killed on it
            messages[self.mid(f'm{i:02d}')] = payload

        # at-least-once delivery: the producer publishes every message twice
        ids = list(messages)
        for message_id in ids:
            self.publish(message_id, messages[message_id])
        rng.shuffle(ids)
        for message_id in ids:
            self.publish(message_id, messages[message_id])

        a = self.consumer('A', self.mode, '--exit-when-empty')
        b = self.consumer('B', self.mode, '--exit-when-empty')
        victim, line = wait_for_line([a, b], 'SLOW', timeout=60)
        victim.popen.send_signal(signal.SIGKILL)
        self.assertEqual(victim.popen.wait(), -signal.SIGKILL)
        slow_id = line.split()[-1]
        self.assertEqual(slow_id, self.mid('m00'))
        survivor = b if victim is a else a
        c = self.consumer('C', self.mode, '--exit-when-empty')
        for p in (survivor, c):
            self.assertEqual(p.wait(120), 0, ''.join(p.output))

        self.assertEqual(self.scalar('SELECT count(*) FROM queue WHERE message_id LIKE %s',
                                     self.run_id + '%'), 0, 'the queue is drained')
        for message_id, payload in messages.items():
            with self.subTest(message=message_id):
                terminal = payload['amount'] <= 0
                status, attempt, body = self.lookup(message_id)
                self.assertGreaterEqual(self.events(message_id, 'received'), 2,
                                        'delivered at least twice')
                self.assertEqual(self.ledger_count(message_id), 0 if terminal else 1,
                                 'booked exactly once (never for a terminal failure)')
                self.assertEqual(status, 'failed' if terminal else 'succeeded')
                if terminal:
                    self.assertEqual(body, failure('"amount" must be a positive integer'))
                else:
                    self.assertEqual(body, {'v': 1, 'json': {'entry_id': self.scalar(
                        'SELECT entry_id FROM ledger WHERE message_id = %s', message_id)}})
                # one copy was settled by its own finish, the other copy acked on replay
                settled = self.events(message_id, 'succeeded') + self.events(message_id, 'failed')
                self.assertEqual(settled, 1, self.events(message_id))
                self.assertGreaterEqual(self.events(message_id, 'replay'), 1,
                                        self.events(message_id))
                if payload.get('transient_failures'):
                    self.assertGreaterEqual(self.events(message_id, 'released'), 1)
                    self.assertGreaterEqual(self.work_starts(message_id), 2)

        # the killed consumer's work started, and was redone: at least once
        self.assertGreaterEqual(self.work_starts(slow_id), 2)
        self.assertEqual(self.ledger_count(slow_id), 1)
        _, attempt, _ = self.lookup(slow_id)
        if self.mode == 'lease':
            # the crash left a pending key; the redelivery took it over
            self.assertEqual(attempt, 2)
        else:
            # the crash rolled the claim back: the redelivery was a first attempt
            self.assertEqual(attempt, 1)
        self.assertEqual(
            self.scalar('SELECT count(*) FROM ledger WHERE message_id LIKE %s', self.run_id + '%'),
            sum(1 for p in messages.values() if p['amount'] > 0))

    def test_in_progress_leaves_the_message_for_redelivery(self):
        message_id = self.mid('busy')
        payload = {'account': 'acct-1', 'amount': 7}
        holder = connect()
        try:
            # another consumer holds the key: an open transaction in tx mode,
            # a committed claim with a live lease in lease mode
            if self.mode == 'tx':
                holder.execute('BEGIN')
            outcome, token = holder.execute(
                """SELECT outcome, token FROM idempotency.idem_claim(
                       %s, %s, scope => %s, lease => '1 hour')""",
                (message_id, Jsonb(payload), SCOPE)).fetchone()
            self.assertEqual(outcome, 'claimed')
            self.publish(message_id, payload)

            p = self.consumer('once', self.mode, '--once')
            self.assertEqual(p.wait(30), 0, ''.join(p.output))
            self.assertEqual(self.events(message_id), ['received', 'in_progress'])
            self.assertEqual(self.queued(message_id), 1, 'not acknowledged')
            self.assertTrue(self.scalar(
                'SELECT visible_at > clock_timestamp() FROM queue WHERE message_id = %s',
                message_id), 'hidden until retry_after')
            self.assertEqual(self.ledger_count(message_id), 0)
            self.assertEqual(self.work_starts(message_id), 0)

            # the holder gives up; the redelivery books it
            if self.mode == 'tx':
                holder.execute('ROLLBACK')
            else:
                holder.execute('SELECT idempotency.idem_release(%s, %s, %s)',
                               (message_id, token, SCOPE))
        finally:
            holder.close()
        self.db.execute('UPDATE queue SET visible_at = now() WHERE message_id = %s', (message_id,))
        self.drain(self.mode)
        self.assertEqual(self.ledger_count(message_id), 1)
        self.assertEqual(self.lookup(message_id)[:2], ('succeeded', 1))
        self.assertEqual(self.events(message_id)[-2:], ['received', 'succeeded'])

    def test_terminal_failure_is_stored_and_replayed(self):
        message_id = self.mid('bad')
        payload = {'account': '', 'amount': 10}
        self.publish(message_id, payload)
        self.publish(message_id, payload)
        self.drain(self.mode)
        status, attempt, body = self.lookup(message_id)
        self.assertEqual((status, attempt), ('failed', 1))
        self.assertEqual(body, failure('"account" must be a non-empty string'))
        self.assertEqual(self.events(message_id),
                         ['received', 'failed', 'received', 'replay'])
        self.assertEqual(self.ledger_count(message_id), 0)
        self.assertEqual(self.work_starts(message_id), 1, 'the failure was not retried')

    def test_retryable_failure_is_released_and_retried(self):
        message_id = self.mid('flaky')
        self.publish(message_id, {'account': 'acct-2', 'amount': 9, 'transient_failures': 2})
        self.drain(self.mode)
        self.assertEqual(self.events(message_id), [
            'received', 'released', 'received', 'released', 'received', 'succeeded'])
        self.assertEqual(self.work_starts(message_id), 3)
        self.assertEqual(self.ledger_count(message_id), 1)
        # a release leaves no key behind: every retry was a fresh first attempt
        self.assertEqual(self.scalar(
            'SELECT array_agg(attempt ORDER BY id) FROM work_log WHERE message_id = %s',
            message_id), [1, 1, 1])
        self.assertEqual(self.lookup(message_id)[:2], ('succeeded', 1))

    def test_reused_id_with_another_payload_is_dead_lettered(self):
        message_id = self.mid('reused')
        self.publish(message_id, {'account': 'acct-3', 'amount': 5})
        self.publish(message_id, {'account': 'acct-3', 'amount': 500})
        self.drain(self.mode)
        self.assertEqual(self.events(message_id),
                         ['received', 'succeeded', 'received', 'mismatch'])
        self.assertEqual(self.ledger_count(message_id), 1)
        self.assertEqual(self.scalar(
            "SELECT payload->>'amount' FROM dead_letters WHERE message_id = %s", message_id), '500')


class TransactionModeTest(BothModes, ConsumerTestCase):
    mode = 'tx'


class LeaseModeTest(BothModes, ConsumerTestCase):
    mode = 'lease'


if __name__ == '__main__':
    unittest.main()
