--
-- takeover.sql: a pending key whose lease ended is taken over by the next
-- matching claim (attempt + 1, a new larger token); the old token is dead
-- (55006) and, once the key is finished, meets a finished key (55000).
--
\set VERBOSITY sqlstate
CREATE TEMP TABLE r (step text PRIMARY KEY, outcome text, token bigint,
	attempt int, status text, response_code int, response_body jsonb,
	retry_after int, phase text, phase_data jsonb, n serial);

INSERT INTO r SELECT 'a1', * FROM idempotency.idem_claim('t1', '{"job": 1}', 'takeover', lease => '1 second')
RETURNING step, outcome, token IS NOT NULL AS has_token, attempt;
INSERT INTO r SELECT 'b1', * FROM idempotency.idem_claim('t2', '{"job": 2}', 'takeover', lease => '1 second')
RETURNING step, outcome, token IS NOT NULL AS has_token, attempt;
-- still live: in_progress with retry_after 1 (the lease ends within a second)
INSERT INTO r SELECT 'a1-live', * FROM idempotency.idem_claim('t1', '{"job": 1}', 'takeover')
RETURNING step, outcome, token, retry_after;
SELECT token AS a1 FROM r WHERE step = 'a1' \gset
SELECT token AS b1 FROM r WHERE step = 'b1' \gset
SELECT pg_sleep(1.1);
-- A key taken over keeps its earlier sweep_at, which is due: the background
-- worker may reschedule it at any moment (memcheck runs it every second).
-- So "unchanged" compares every column but that bookkeeping one.
\set row_cols 'k.scope, k.key, k.status, k.token, k.attempt, k.fingerprint, k.response_code, k.response_body, k.created_at, k.finished_at, k.lease_until, k.expires_at, k.retention'

-- A different request is still a mismatch after the lease ended: only a
-- matching claim takes over.
INSERT INTO r SELECT 'a-mismatch', * FROM idempotency.idem_claim('t1', '{"job": 99}', 'takeover')
RETURNING step, outcome, token, attempt, status, response_code, response_body, retry_after;
SELECT status, attempt FROM idempotency.keys WHERE scope = 'takeover' AND key = 't1';

-- The matching claim takes over: claimed, attempt 2, a new larger token.
SELECT clock_timestamp() AS before_a2 \gset
INSERT INTO r SELECT 'a2', * FROM idempotency.idem_claim('t1', '{"job": 1}', 'takeover')
RETURNING step, outcome, token IS NOT NULL AS has_token, attempt, status,
          response_code, response_body, retry_after;
SELECT clock_timestamp() AS after_a2 \gset
SELECT token AS a2 FROM r WHERE step = 'a2' \gset
SELECT :a2 > :a1 AS larger_token, :a2 > :b1 AS larger_than_any_before;
SELECT k.status, k.attempt, k.token = :a2 AS new_token_stored,
       k.lease_until BETWEEN :'before_a2'::timestamptz + '30 s'
                         AND :'after_a2'::timestamptz + '30 s' AS fresh_default_lease,
       k.finished_at, k.response_body
  FROM idempotency.keys k WHERE k.scope = 'takeover' AND k.key = 't1';
SELECT (:row_cols)::text AS t1_row FROM idempotency.keys k WHERE k.scope = 'takeover' AND k.key = 't1' \gset

-- The old token is dead: finish, extend and release raise 55006 and change
-- nothing.
SELECT idempotency.idem_finish('t1', :a1, 200, '{"from": "old"}', 'takeover');
SELECT idempotency.idem_extend('t1', :a1, '1 hour', 'takeover');
SELECT idempotency.idem_release('t1', :a1, 'takeover');
SELECT (:row_cols)::text = :'t1_row' AS unchanged FROM idempotency.keys k
 WHERE k.scope = 'takeover' AND k.key = 't1';

-- The new owner's claim is live.
INSERT INTO r SELECT 'a2-live', * FROM idempotency.idem_claim('t1', '{"job": 1}', 'takeover')
RETURNING step, outcome, token, retry_after BETWEEN 1 AND 30 AS retry_after_in_lease;

-- The new owner finishes; now the old token meets a key finished by another
-- token: 55000 for finish, release and extend alike.
SELECT idempotency.idem_finish('t1', :a2, 200, '{"from": "new"}', 'takeover') AS e2 \gset
SELECT (:row_cols)::text AS t1_row FROM idempotency.keys k WHERE k.scope = 'takeover' AND k.key = 't1' \gset
SELECT idempotency.idem_finish('t1', :a1, 200, '{"from": "old"}', 'takeover');
SELECT idempotency.idem_release('t1', :a1, 'takeover');
SELECT idempotency.idem_extend('t1', :a1, '1 hour', 'takeover');
SELECT idempotency.idem_finish('t1', :a2, 200, '{"from": "new"}', 'takeover') = :'e2' AS same_expiry;
SELECT (:row_cols)::text = :'t1_row' AS unchanged, k.status, k.attempt, k.response_body
  FROM idempotency.keys k WHERE k.scope = 'takeover' AND k.key = 't1';
INSERT INTO r SELECT 'a-replay', * FROM idempotency.idem_claim('t1', '{"job": 1}', 'takeover')
RETURNING step, outcome, token, attempt, status, response_code, response_body, retry_after;

-- Takeovers go on: attempt 2 with a short lease, then attempt 3.
INSERT INTO r SELECT 'b2', * FROM idempotency.idem_claim('t2', '{"job": 2}', 'takeover', lease => '1 second')
RETURNING step, outcome, attempt;
INSERT INTO r SELECT 'r1', * FROM idempotency.idem_claim('t5', scope => 'takeover',
       lease => '1 second', retention => '1 hour')
RETURNING step, outcome, attempt;
SELECT pg_sleep(1.1);
-- a takeover is a claim: its own lease and retention (not the first claim's)
SELECT clock_timestamp() AS before_r2 \gset
INSERT INTO r SELECT 'r2', * FROM idempotency.idem_claim('t5', scope => 'takeover',
       lease => '2 minutes', retention => '7 days')
RETURNING step, outcome, attempt;
SELECT clock_timestamp() AS after_r2 \gset
SELECT k.retention = '7 days' AS takeover_retention,
       k.lease_until BETWEEN :'before_r2'::timestamptz + '2 minutes'
                         AND :'after_r2'::timestamptz + '2 minutes' AS takeover_lease,
       k.expires_at BETWEEN :'before_r2'::timestamptz + '7 days'
                        AND :'after_r2'::timestamptz + '7 days' AS expires_7d
  FROM idempotency.keys k WHERE k.scope = 'takeover' AND k.key = 't5';
INSERT INTO r SELECT 'b3', * FROM idempotency.idem_claim('t2', '{"job": 2}', 'takeover')
RETURNING step, outcome, attempt;
SELECT (SELECT token FROM r WHERE step = 'b3') > (SELECT token FROM r WHERE step = 'b2')
   AND (SELECT token FROM r WHERE step = 'b2') > :a2 AS increasing;
SELECT idempotency.idem_finish('t2', token, 200, NULL, 'takeover') FROM r WHERE step = 'b2';
SELECT idempotency.idem_release('t2', token, 'takeover') FROM r WHERE step = 'b1';
SELECT idempotency.idem_finish('t2', token, 200, '{"attempt": 3}', 'takeover') IS NOT NULL AS finished
  FROM r WHERE step = 'b3';
SELECT status, attempt, response_body FROM idempotency.keys WHERE scope = 'takeover' AND key = 't2';

--
-- A takeover rolled back (to a savepoint) leaves the old token current; the
-- token it drew is not reused.  The row lock keeps the background sweeper
-- from resetting the key while we sleep.
--
INSERT INTO r SELECT 'c1', * FROM idempotency.idem_claim('t3', '{"job": 3}', 'takeover', lease => '1 second')
RETURNING step, outcome, attempt;
SELECT token AS c1 FROM r WHERE step = 'c1' \gset
BEGIN;
SELECT count(*) AS locked
  FROM (SELECT 1 FROM idempotency.keys WHERE scope = 'takeover' AND key = 't3' FOR UPDATE) l;
SELECT pg_sleep(1.1);
SAVEPOINT before_takeover;
SELECT outcome, attempt, token > :c1 AS larger FROM idempotency.idem_claim('t3', '{"job": 3}', 'takeover');
SELECT attempt, token > :c1 AS taken_over FROM idempotency.keys WHERE scope = 'takeover' AND key = 't3';
SELECT token AS rolled_back_token FROM idempotency.keys WHERE scope = 'takeover' AND key = 't3' \gset
ROLLBACK TO SAVEPOINT before_takeover;
SELECT attempt, token = :c1 AS old_token_back FROM idempotency.keys WHERE scope = 'takeover' AND key = 't3';
SELECT idempotency.idem_finish('t3', :c1, 200, '{"attempt": 1}', 'takeover') IS NOT NULL AS finished;
COMMIT;
SELECT status, attempt, token = :c1 AS same_token, response_body
  FROM idempotency.keys WHERE scope = 'takeover' AND key = 't3';
INSERT INTO r SELECT 'd1', * FROM idempotency.idem_claim('t4', scope => 'takeover')
RETURNING step, outcome, attempt, token > :rolled_back_token AS not_reused;

SELECT bool_and(token > prev) AS strictly_increasing
  FROM (SELECT token, lag(token) OVER (ORDER BY n) AS prev
          FROM r WHERE token IS NOT NULL) s
 WHERE prev IS NOT NULL;

DELETE FROM idempotency.keys WHERE scope = 'takeover';
