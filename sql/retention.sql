--
-- retention.sql: a key past its retention behaves exactly as an absent key
-- for every function, whether or not a sweep has removed it yet.
--
-- The rows are locked (FOR UPDATE) by this session while their retention
-- passes: the sweeper skips locked rows, so they are provably still in the
-- table when the functions answer "absent".
--
\set VERBOSITY sqlstate
CREATE TEMP TABLE r (step text PRIMARY KEY, outcome text, token bigint,
	attempt int, status text, response_code int, response_body jsonb,
	retry_after int, phase text, phase_data jsonb, n serial);

-- p1: succeeded, kept 1 s;  p2: failed, kept 1 s
-- p3: pending, lease 1 s, retention 1 s (never finished)
-- p4: pending, retention 1 s but a live 1 hour lease (kept until its end)
-- p5: claimed with retention 1 s, finished with retention 1 hour
INSERT INTO r SELECT 'p1', * FROM idempotency.idem_claim('p1', '{"v": 1}', 'retention', retention => '1 second')
RETURNING step, outcome, attempt;
INSERT INTO r SELECT 'p2', * FROM idempotency.idem_claim('p2', '{"v": 2}', 'retention')
RETURNING step, outcome, attempt;
INSERT INTO r SELECT 'p3', * FROM idempotency.idem_claim('p3', '{"v": 3}', 'retention',
       lease => '1 second', retention => '1 second')
RETURNING step, outcome, attempt;
INSERT INTO r SELECT 'p4', * FROM idempotency.idem_claim('p4', '{"v": 4}', 'retention',
       lease => '1 hour', retention => '1 second')
RETURNING step, outcome, attempt;
INSERT INTO r SELECT 'p5', * FROM idempotency.idem_claim('p5', '{"v": 5}', 'retention', retention => '1 second')
RETURNING step, outcome, attempt;
SELECT token AS p1 FROM r WHERE step = 'p1' \gset
SELECT token AS p2 FROM r WHERE step = 'p2' \gset
SELECT token AS p3 FROM r WHERE step = 'p3' \gset
SELECT token AS p4 FROM r WHERE step = 'p4' \gset
SELECT token AS p5 FROM r WHERE step = 'p5' \gset
SELECT idempotency.idem_finish('p1', :p1, 200, '{"r": 1}', 'retention') IS NOT NULL AS finished;
SELECT idempotency.idem_finish('p2', :p2, 500, '{"r": 2}', 'retention', 'failed', '1 second') IS NOT NULL AS finished;
SELECT idempotency.idem_finish('p5', :p5, 200, '{"r": 5}', 'retention', retention => '1 hour') IS NOT NULL AS finished;

BEGIN;
SELECT count(*) AS locked
  FROM (SELECT 1 FROM idempotency.keys WHERE scope = 'retention' FOR UPDATE) l;
SELECT pg_sleep(1.1);
-- all five rows are still there, three of them past their expiry
SELECT key, status, expires_at <= clock_timestamp() AS past_retention
  FROM idempotency.keys WHERE scope = 'retention' ORDER BY key;
-- lookup: no row for the three
SELECT key, (SELECT count(*) FROM idempotency.idem_lookup(key, 'retention')) AS lookup_rows
  FROM (VALUES ('p1'), ('p2'), ('p3'), ('p4'), ('p5')) v(key) ORDER BY key;
-- finish/release/extend: absent (P0002), even a repeated finish with the
-- token that finished it
SAVEPOINT s;
SELECT idempotency.idem_finish('p1', :p1, 200, '{"r": 1}', 'retention');
ROLLBACK TO SAVEPOINT s;
SELECT idempotency.idem_finish('p3', :p3, 200, NULL, 'retention');
ROLLBACK TO SAVEPOINT s;
SELECT idempotency.idem_release('p3', :p3, 'retention');
ROLLBACK TO SAVEPOINT s;
SELECT idempotency.idem_extend('p3', :p3, '1 hour', 'retention');
ROLLBACK TO SAVEPOINT s;
SELECT idempotency.idem_release('p1', :p1, 'retention');
ROLLBACK TO SAVEPOINT s;
SELECT idempotency.idem_extend('p2', :p2, '1 hour', 'retention');
ROLLBACK TO SAVEPOINT s;
-- nothing changed
SELECT count(*) AS rows FROM idempotency.keys WHERE scope = 'retention';
COMMIT;

-- claim: a fresh first attempt, with any payload (no mismatch, no replay,
-- no takeover)
INSERT INTO r SELECT 'p1-new', * FROM idempotency.idem_claim('p1', '{"v": "other"}', 'retention')
RETURNING step, outcome, attempt, status, response_code, response_body, token > :p5 AS larger_token;
INSERT INTO r SELECT 'p2-new', * FROM idempotency.idem_claim('p2', '{"v": 2}', 'retention')
RETURNING step, outcome, attempt, status, response_code, response_body;
INSERT INTO r SELECT 'p3-new', * FROM idempotency.idem_claim('p3', '{"v": "other"}', 'retention')
RETURNING step, outcome, attempt;
-- the live lease kept p4, the finish's retention kept p5
INSERT INTO r SELECT 'p4-again', * FROM idempotency.idem_claim('p4', '{"v": 4}', 'retention')
RETURNING step, outcome, token, retry_after BETWEEN 3500 AND 3600 AS retry_after_1h;
INSERT INTO r SELECT 'p5-again', * FROM idempotency.idem_claim('p5', '{"v": 5}', 'retention')
RETURNING step, outcome, status, response_code, response_body;
-- the fresh rows carry nothing of the old ones
SELECT k.key, k.status, k.attempt, k.token = r.token AS new_token, k.finished_at,
       k.response_code, k.response_body,
       k.fingerprint = sha256(convert_to(
           CASE k.key WHEN 'p2' THEN '{"v": 2}' ELSE '{"v": "other"}' END::jsonb::text,
           'UTF8')) AS new_fingerprint
  FROM idempotency.keys k JOIN r ON r.step = k.key || '-new'
 WHERE k.scope = 'retention' ORDER BY k.key;
-- the old tokens are of no use on them
SELECT idempotency.idem_finish('p1', :p1, 200, NULL, 'retention');
SELECT idempotency.idem_release('p3', :p3, 'retention');

DELETE FROM idempotency.keys WHERE scope = 'retention';
