--
-- claim_many.sql: idem_claim_many answers one row per key, in array order
-- (ord from 1), each as idem_claim would if the keys were claimed one
-- after another in one transaction: new keys claimed, finished ones
-- replayed, other requests mismatched, live ones in_progress, stale ones
-- taken over (with their checkpoint), a key repeated in the batch
-- in_progress.  Bad input raises its own SQLSTATE before any key is
-- claimed; an empty batch answers nothing; 10,000 keys work with default
-- settings, session-bound too; the stats view counts each element.
--
\set VERBOSITY terse
CREATE TEMP TABLE r (step text PRIMARY KEY, outcome text, token bigint,
	attempt int, status text, response_code int, response_body jsonb,
	retry_after int, phase text, phase_data jsonb, n serial);
CREATE TEMP TABLE b (batch text, ord int, key text, outcome text, token bigint,
	attempt int, status text, response_code int, response_body jsonb,
	retry_after int, phase text, phase_data jsonb, PRIMARY KEY (batch, ord));
-- Every column but sweep_at: the background worker may reschedule a key
-- taken over at any moment (that bookkeeping is no change a caller sees).
CREATE TEMP VIEW cm_state AS
SELECT count(*) AS rows,
       md5(coalesce(string_agg((k.scope, k.key, k.status, k.token, k.attempt,
           k.fingerprint, k.response_code, k.response_body, k.created_at,
           k.finished_at, k.lease_until, k.expires_at, k.retention, k.phase,
           k.phase_data, k.owner_session)::text, '|' ORDER BY k.key), '')) AS sum
  FROM idempotency.keys k WHERE k.scope = 'claim_many';
-- one row, also where the stats view has none for this database (the
-- counters are NULL where the SQL edition runs, and \gset keeps no NULL)
CREATE TEMP VIEW counters AS
SELECT s.claims, s.takeovers, s.replays, s.in_progress, s.mismatches
  FROM (SELECT 1) one
  LEFT JOIN idempotency.stats s ON s.database = current_database();
-- Waits until the wall clock passes "t" (a lease).
CREATE FUNCTION pg_temp.wait_past(t timestamptz) RETURNS boolean
LANGUAGE plpgsql AS $$
BEGIN
	WHILE clock_timestamp() <= t LOOP
		PERFORM pg_sleep(0.005);
	END LOOP;
	RETURN true;
END
$$;

--
-- New keys: claimed in array order, attempt 1, increasing tokens.
--
INSERT INTO b SELECT 'new', * FROM idempotency.idem_claim_many(
       ARRAY['n3', 'n1', 'n2'], ARRAY['{"n": 3}', '{"n": 1}', '{"n": 2}']::jsonb[], 'claim_many')
RETURNING ord, key, outcome, attempt, status, response_code, response_body,
          retry_after, phase, phase_data;
SELECT bool_and(token > prev) AS increasing_in_order
  FROM (SELECT token, lag(token) OVER (ORDER BY ord) AS prev FROM b WHERE batch = 'new') s
 WHERE prev IS NOT NULL;
-- each row stored as idem_claim stores it: the request's fingerprint,
-- the claim's token, the default lease, no session
SELECT k.key, k.status, k.attempt, k.token = b.token AS same_token,
       k.fingerprint = sha256(convert_to(jsonb_build_object('n', substr(k.key, 2)::int)::text, 'UTF8')) AS fingerprint,
       k.lease_until - k.created_at AS lease, k.owner_session
  FROM idempotency.keys k JOIN b ON b.batch = 'new' AND b.key = k.key
 WHERE k.scope = 'claim_many' ORDER BY k.key;
-- the same batch again: all in progress, nothing written
SELECT sum AS sum0 FROM cm_state \gset
SELECT ord, key, outcome, token, attempt, retry_after BETWEEN 1 AND 30 AS retry_in_lease
  FROM idempotency.idem_claim_many(ARRAY['n3', 'n1', 'n2'],
       ARRAY['{"n": 3}', '{"n": 1}', '{"n": 2}']::jsonb[], 'claim_many');
SELECT sum = :'sum0' AS unchanged FROM cm_state;

--
-- A key repeated in the batch: the repeat answers in_progress with
-- retry_after 1 (it is this batch's own claim), like a second idem_claim
-- in the same transaction.
--
SELECT ord, key, outcome, attempt, retry_after
  FROM idempotency.idem_claim_many(ARRAY['d1', 'd2', 'd1', 'd1'], scope => 'claim_many');
SELECT key, attempt FROM idempotency.keys WHERE scope = 'claim_many' AND key LIKE 'd_' ORDER BY key;
BEGIN;
SELECT outcome FROM idempotency.idem_claim('d3', scope => 'claim_many');
SELECT outcome, retry_after FROM idempotency.idem_claim('d3', scope => 'claim_many');
ROLLBACK;

--
-- A mixture: replay (finished), mismatch (another request), in_progress
-- (a live lease), a takeover (lease over, with its checkpoint) and a new
-- key, answered in array order.  A NULL element of requests means no
-- request, which matches only a key claimed without one.
--
INSERT INTO r SELECT 'done', * FROM idempotency.idem_claim('done', '{"v": 1}', 'claim_many')
RETURNING step, outcome;
SELECT idempotency.idem_finish('done', token, 201, '{"id": 7}', 'claim_many') IS NOT NULL AS finished
  FROM r WHERE step = 'done';
INSERT INTO r SELECT 'noreq', * FROM idempotency.idem_claim('noreq', NULL, 'claim_many')
RETURNING step, outcome;
SELECT idempotency.idem_finish('noreq', token, 204, NULL, 'claim_many', 'failed') IS NOT NULL AS finished
  FROM r WHERE step = 'noreq';
INSERT INTO r SELECT 'stale', * FROM idempotency.idem_claim('stale', '{"v": 3}', 'claim_many')
RETURNING step, outcome;
SELECT idempotency.idem_checkpoint('stale', token, 'step_2', '{"resume": "here"}', 'claim_many'),
       idempotency.idem_extend('stale', token, '1 ms', 'claim_many') IS NOT NULL AS extended
  FROM r WHERE step = 'stale';
SELECT pg_temp.wait_past(lease_until) FROM idempotency.keys
 WHERE scope = 'claim_many' AND key = 'stale';
SELECT coalesce(claims, 0) AS claims, coalesce(takeovers, 0) AS takeovers,
       coalesce(replays, 0) AS replays, coalesce(in_progress, 0) AS in_progress,
       coalesce(mismatches, 0) AS mismatches FROM counters \gset c0_
INSERT INTO b SELECT 'mix', * FROM idempotency.idem_claim_many(
       ARRAY['done', 'n1', 'n2', 'stale', 'fresh', 'noreq', 'noreq', 'done'],
       ARRAY['{"v": 1}', '{"n": 1}', '{"n": 99}', '{"v": 3}', NULL,
             NULL, '{"x": 1}', NULL]::jsonb[],
       'claim_many')
RETURNING ord, key, outcome, attempt, status, response_code, response_body,
          retry_after BETWEEN 1 AND 30 AS retry_in_lease, phase, phase_data;
SELECT (SELECT token FROM b WHERE batch = 'mix' AND key = 'stale')
       > (SELECT token FROM r WHERE step = 'stale') AS takeover_token_larger,
       (SELECT token FROM b WHERE batch = 'mix' AND key = 'fresh')
       > (SELECT token FROM b WHERE batch = 'mix' AND key = 'stale') AS fresh_token_larger;
SELECT key, status, attempt, fingerprint IS NULL AS no_request, phase, phase_data
  FROM idempotency.keys WHERE scope = 'claim_many' AND key IN ('stale', 'fresh') ORDER BY key;
-- counted once per element: claims 2 (1 takeover), replays 2, in_progress
-- 1, mismatches 3
SELECT claims - :c0_claims AS claims, takeovers - :c0_takeovers AS takeovers,
       replays - :c0_replays AS replays, in_progress - :c0_in_progress AS in_progress,
       mismatches - :c0_mismatches AS mismatches
  FROM counters;
-- the old token of the key taken over is dead (55006)
\set VERBOSITY sqlstate
SELECT idempotency.idem_finish('stale', token, 200, NULL, 'claim_many') FROM r WHERE step = 'stale';
\set VERBOSITY terse

--
-- An empty batch answers no rows and claims nothing.
--
SELECT rows AS rows0, sum AS sum0 FROM cm_state \gset
SELECT count(*) AS rows FROM idempotency.idem_claim_many('{}', scope => 'claim_many');
SELECT count(*) AS rows FROM idempotency.idem_claim_many('{}', '{}', 'claim_many');
SELECT rows = :rows0 AS same_rows, sum = :'sum0' AS unchanged FROM cm_state;

--
-- A batch in a transaction that rolls back leaves nothing; the tokens it
-- drew are not reused.
--
BEGIN;
SELECT ord, key, outcome, attempt
  FROM idempotency.idem_claim_many(ARRAY['rb1', 'rb2'], scope => 'claim_many');
SELECT max(token) AS rolled_back_token FROM idempotency.keys
 WHERE scope = 'claim_many' AND key LIKE 'rb_' \gset
ROLLBACK;
SELECT count(*) AS rows FROM idempotency.keys WHERE scope = 'claim_many' AND key LIKE 'rb_';
SELECT ord, outcome, attempt, token > :rolled_back_token AS not_reused
  FROM idempotency.idem_claim_many(ARRAY['rb1'], scope => 'claim_many');

--
-- Bad input: its own SQLSTATE, before any key is claimed (new keys in
-- the same batch included), and the table unchanged.
--
SELECT rows AS rows0, sum AS sum0 FROM cm_state \gset
\set unchanged 'SELECT :''LAST_ERROR_SQLSTATE'' AS sqlstate, sum = :''sum0'' AS unchanged FROM cm_state;'
-- requests of another length than keys: 22023
SELECT * FROM idempotency.idem_claim_many(ARRAY['bad1', 'bad2'], ARRAY['{}']::jsonb[], 'claim_many');
:unchanged
SELECT * FROM idempotency.idem_claim_many(ARRAY['bad1'], ARRAY['{}', '{}']::jsonb[], 'claim_many');
:unchanged
SELECT * FROM idempotency.idem_claim_many(ARRAY['bad1'], '{}', 'claim_many');
:unchanged
-- NULL keys, NULL element of keys: 22004
SELECT * FROM idempotency.idem_claim_many(NULL, scope => 'claim_many');
:unchanged
SELECT * FROM idempotency.idem_claim_many(ARRAY['bad1', NULL, 'bad3'], scope => 'claim_many');
:unchanged
SELECT * FROM idempotency.idem_claim_many(ARRAY[NULL]::text[], scope => 'claim_many');
:unchanged
-- an empty key: 22023; a key over 255 characters: 22001 (named by position)
SELECT * FROM idempotency.idem_claim_many(ARRAY['bad1', ''], scope => 'claim_many');
:unchanged
SELECT * FROM idempotency.idem_claim_many(ARRAY['bad1', 'bad2', repeat('k', 256)], scope => 'claim_many');
:unchanged
-- arrays of more than one dimension: 22023
SELECT * FROM idempotency.idem_claim_many(ARRAY[['bad1', 'bad2'], ['bad3', 'bad4']], scope => 'claim_many');
:unchanged
SELECT * FROM idempotency.idem_claim_many(ARRAY['bad1', 'bad2'],
       ARRAY[ARRAY['{}'::jsonb], ARRAY['{}'::jsonb]], 'claim_many');
:unchanged
-- NULL scope: 22004; a scope over 255 characters: 22001
SELECT * FROM idempotency.idem_claim_many(ARRAY['bad1'], scope => NULL);
:unchanged
SELECT * FROM idempotency.idem_claim_many(ARRAY['bad1'], scope => repeat('s', 256));
:unchanged
-- lease or retention not positive: 22023
SELECT * FROM idempotency.idem_claim_many(ARRAY['bad1'], scope => 'claim_many', lease => '0');
:unchanged
SELECT * FROM idempotency.idem_claim_many(ARRAY['bad1'], scope => 'claim_many', lease => '-1 second');
:unchanged
SELECT * FROM idempotency.idem_claim_many(ARRAY['bad1'], scope => 'claim_many', retention => '0');
:unchanged
SELECT * FROM idempotency.idem_claim_many(ARRAY['bad1'], scope => 'claim_many', retention => '-1 day');
:unchanged
-- session_bound NULL: 22004
SELECT * FROM idempotency.idem_claim_many(ARRAY['bad1'], scope => 'claim_many', session_bound => NULL);
:unchanged
SELECT rows = :rows0 AS same_rows, sum = :'sum0' AS unchanged FROM cm_state;

-- A batch's own lease and retention apply to each key it claims.
SELECT clock_timestamp() AS before_lr \gset
SELECT ord, key, outcome, attempt FROM idempotency.idem_claim_many(ARRAY['lr1', 'lr2'],
       scope => 'claim_many', lease => '2 minutes', retention => '7 days');
SELECT clock_timestamp() AS after_lr \gset
SELECT key, retention,
       lease_until BETWEEN :'before_lr'::timestamptz + '2 minutes'
                       AND :'after_lr'::timestamptz + '2 minutes' AS lease_2min,
       expires_at BETWEEN :'before_lr'::timestamptz + '7 days'
                      AND :'after_lr'::timestamptz + '7 days' AS expires_7d
  FROM idempotency.keys WHERE scope = 'claim_many' AND key LIKE 'lr_' ORDER BY key;

DELETE FROM idempotency.keys WHERE scope = 'claim_many';

--
-- 10,000 keys in one batch, with default settings: all claimed, no lock
-- left behind; the same batch again: all in progress.  (A long lease, so
-- that a slow build cannot see the first keys' leases end meanwhile.)
--
SELECT coalesce(claims, 0) AS claims, coalesce(takeovers, 0) AS takeovers,
       coalesce(replays, 0) AS replays, coalesce(in_progress, 0) AS in_progress,
       coalesce(mismatches, 0) AS mismatches FROM counters \gset c0_
BEGIN;
SELECT outcome, attempt, count(*) AS keys, count(DISTINCT token) AS tokens,
       count(*) FILTER (WHERE key = 'm' || ord) AS in_order
  FROM idempotency.idem_claim_many(ARRAY(SELECT 'm' || g FROM generate_series(1, 10000) g),
                                    scope => 'claim_many', lease => '1 hour')
 GROUP BY outcome, attempt;
SELECT count(*) AS advisory_locks FROM pg_locks
 WHERE pid = pg_backend_pid() AND locktype = 'advisory';
SELECT count(*) < 100 AS few_locks FROM pg_locks WHERE pid = pg_backend_pid();
COMMIT;
SELECT claims - :c0_claims AS claims FROM counters;
SELECT status, attempt, count(*) AS rows, count(owner_session) AS bound
  FROM idempotency.keys WHERE scope = 'claim_many' GROUP BY status, attempt;
SELECT outcome, count(*) AS keys, count(token) AS tokens,
       count(*) FILTER (WHERE retry_after BETWEEN 1 AND 3600) AS retry_in_lease
  FROM idempotency.idem_claim_many(ARRAY(SELECT 'm' || g FROM generate_series(1, 10000) g),
                                    scope => 'claim_many')
 GROUP BY outcome;
SELECT claims - :c0_claims AS claims, in_progress - :c0_in_progress AS in_progress FROM counters;

DELETE FROM idempotency.keys WHERE scope = 'claim_many';

--
-- A session-bound batch binds every key to this session, one binding and
-- one lock for all 10,000.
--
SELECT outcome, count(*) AS keys
  FROM idempotency.idem_claim_many(ARRAY(SELECT 's' || g FROM generate_series(1, 10000) g),
                                    scope => 'claim_many', lease => '1 hour', session_bound => true)
 GROUP BY outcome;
SELECT count(*) AS rows, count(owner_session) AS bound, count(DISTINCT owner_session) AS bindings
  FROM idempotency.keys WHERE scope = 'claim_many';
SELECT count(*) AS binding_locks FROM pg_locks l, idempotency.keys k
 WHERE l.locktype = 'advisory' AND l.pid = pg_backend_pid() AND l.objsubid = 7656
   AND (l.classid::bigint << 32) | l.objid::bigint = k.owner_session
   AND k.scope = 'claim_many' AND k.key = 's1';
-- the session's own keys are in progress to it
SELECT outcome, count(*) AS keys
  FROM idempotency.idem_claim_many(ARRAY['s1', 's10000'], scope => 'claim_many')
 GROUP BY outcome;

DELETE FROM idempotency.keys WHERE scope = 'claim_many';
