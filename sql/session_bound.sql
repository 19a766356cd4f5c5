--
-- session_bound.sql: idem_claim(..., session_bound => true) ties the
-- pending key to this server session (owner_session; one session-level
-- advisory lock per session, whatever the number of keys).  The token
-- works as usual while the session lives, and the session's own claim
-- answers in_progress; finish unbinds the key.  Once the binding is let go
-- (pg_advisory_unlock_all(), DISCARD ALL: the same as the session ending,
-- seen from the key) the key is reclaimable at once, before its lease
-- ends, and idem_sweep() resets it; a key whose session lives is left
-- alone.  Sessions that really end are the TAP tests' business.
--
\set VERBOSITY sqlstate
CREATE TEMP TABLE r (step text PRIMARY KEY, outcome text, token bigint,
	attempt int, status text, response_code int, response_body jsonb,
	retry_after int, phase text, phase_data jsonb, n serial);
-- Every column but sweep_at: the background worker may reschedule a key
-- taken over at any moment (that bookkeeping is no change a caller sees).
CREATE TEMP VIEW sb_state AS
SELECT md5(coalesce(string_agg((k.scope, k.key, k.status, k.token, k.attempt,
           k.fingerprint, k.response_code, k.response_body, k.created_at,
           k.finished_at, k.lease_until, k.expires_at, k.retention, k.phase,
           k.phase_data, k.owner_session)::text, '|' ORDER BY k.key), '')) AS sum
  FROM idempotency.keys k WHERE k.scope = 'session_bound';
CREATE TEMP VIEW sb AS
SELECT key, status, attempt, owner_session IS NOT NULL AS bound
  FROM idempotency.keys WHERE scope = 'session_bound';
-- This session's binding locks: session-level advisory locks whose fourth
-- field marks them (0x1de8), on the number stored in owner_session.
CREATE TEMP VIEW binding_locks AS
SELECT (classid::bigint << 32) | objid::bigint AS session, mode, granted
  FROM pg_locks
 WHERE locktype = 'advisory' AND pid = pg_backend_pid() AND objsubid = 7656
   AND database = (SELECT oid FROM pg_database WHERE datname = current_database());
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

-- No binding before the first session-bound claim.
SELECT count(*) AS binding_locks FROM binding_locks;

--
-- A plain claim is bound to no session; a session-bound one is.
--
INSERT INTO r SELECT 'p1', * FROM idempotency.idem_claim('plain', scope => 'session_bound')
RETURNING step, outcome, attempt;
INSERT INTO r SELECT 's1', * FROM idempotency.idem_claim('s1', '{"n": 1}', 'session_bound',
       session_bound => true)
RETURNING step, outcome, attempt;
SELECT token AS s1 FROM r WHERE step = 's1' \gset
SELECT * FROM sb ORDER BY key;
SELECT owner_session AS b1 FROM idempotency.keys WHERE scope = 'session_bound' AND key = 's1' \gset
-- the binding is drawn from the token sequence, before the claim's token
SELECT :b1 < :s1 AS drawn_before_token;
-- and this session holds the binding's lock, exclusively, at session level
SELECT session = :b1 AS on_binding, mode, granted FROM binding_locks;

-- More session-bound claims share the binding: still one lock.
INSERT INTO r SELECT 's' || g, c.* FROM generate_series(2, 4) g,
       idempotency.idem_claim('s' || g, scope => 'session_bound', session_bound => true) c;
INSERT INTO r SELECT 's5', * FROM idempotency.idem_claim('s5', scope => 'session_bound',
       lease => '1 ms', session_bound => true)
RETURNING step, outcome, attempt;
SELECT count(*) AS keys, count(DISTINCT owner_session) AS bindings,
       bool_and(owner_session = :b1) AS same_binding
  FROM idempotency.keys WHERE scope = 'session_bound' AND key LIKE 's_';
SELECT count(*) AS binding_locks FROM binding_locks;

-- The session's own claim of its live key answers in_progress, whether
-- session-bound or not; a different request is a mismatch as always.
INSERT INTO r SELECT 's1-again', * FROM idempotency.idem_claim('s1', '{"n": 1}', 'session_bound',
       session_bound => true)
RETURNING step, outcome, token, retry_after BETWEEN 1 AND 30 AS retry_in_lease;
INSERT INTO r SELECT 's1-plain', * FROM idempotency.idem_claim('s1', '{"n": 1}', 'session_bound')
RETURNING step, outcome, token, retry_after BETWEEN 1 AND 30 AS retry_in_lease;
INSERT INTO r SELECT 's1-other', * FROM idempotency.idem_claim('s1', '{"n": 2}', 'session_bound',
       session_bound => true)
RETURNING step, outcome, token;

-- The lease still applies to a session-bound key: once it ended, the key
-- is taken over although its session lives.
SELECT pg_temp.wait_past(lease_until) FROM idempotency.keys
 WHERE scope = 'session_bound' AND key = 's5';
INSERT INTO r SELECT 's5-takeover', * FROM idempotency.idem_claim('s5', scope => 'session_bound')
RETURNING step, outcome, attempt;
SELECT * FROM sb WHERE key = 's5';

-- The token works: extend and checkpoint keep the binding, finish
-- clears it.
SELECT idempotency.idem_extend('s1', :s1, '10 minutes', 'session_bound') > clock_timestamp() AS extended;
SELECT idempotency.idem_checkpoint('s1', :s1, 'half_way', '{"at": 1}', 'session_bound');
SELECT key, status, attempt, owner_session = :b1 AS same_binding, phase, phase_data
  FROM idempotency.keys WHERE scope = 'session_bound' AND key = 's1';
SELECT idempotency.idem_finish('s1', :s1, 200, '{"done": 1}', 'session_bound') IS NOT NULL AS finished;
SELECT * FROM sb WHERE key = 's1';
INSERT INTO r SELECT 's1-replay', * FROM idempotency.idem_claim('s1', '{"n": 1}', 'session_bound',
       session_bound => true)
RETURNING step, outcome, status, response_body;
-- release deletes a session-bound key like any other
SELECT idempotency.idem_release('s4', token, 'session_bound') FROM r WHERE step = 's4';
SELECT count(*) AS rows FROM sb WHERE key = 's4';

-- session_bound must not be NULL (22004); nothing changes.
SELECT sum AS sum0 FROM sb_state \gset
SELECT * FROM idempotency.idem_claim('s2', scope => 'session_bound', session_bound => NULL);
SELECT * FROM idempotency.idem_claim('new', scope => 'session_bound', session_bound => NULL);
SELECT sum = :'sum0' AS unchanged FROM sb_state;

--
-- pg_advisory_unlock_all() lets the binding go: the keys bound before are
-- reclaimable at once, long before their lease ends.  The takeover by a
-- session-bound claim takes a new binding; one by a plain claim unbinds
-- the key.  The old tokens are dead.
--
SELECT pg_advisory_unlock_all();
SELECT count(*) AS binding_locks FROM binding_locks;
SELECT key, lease_until > clock_timestamp() + '10 seconds' AS lease_runs
  FROM idempotency.keys WHERE scope = 'session_bound' AND key IN ('s2', 's3') ORDER BY key;
INSERT INTO r SELECT 's2-takeover', * FROM idempotency.idem_claim('s2', scope => 'session_bound',
       session_bound => true)
RETURNING step, outcome, attempt;
INSERT INTO r SELECT 's3-takeover', * FROM idempotency.idem_claim('s3', scope => 'session_bound')
RETURNING step, outcome, attempt;
SELECT owner_session AS b2 FROM idempotency.keys WHERE scope = 'session_bound' AND key = 's2' \gset
SELECT :b2 > :b1 AS new_binding,
       :b2 < (SELECT token FROM r WHERE step = 's2-takeover') AS drawn_before_token;
SELECT session = :b2 AS on_new_binding, mode, granted FROM binding_locks;
SELECT * FROM sb WHERE key IN ('s2', 's3') ORDER BY key;
SELECT idempotency.idem_checkpoint('s2', token, 'stale', NULL, 'session_bound') FROM r WHERE step = 's2';
SELECT idempotency.idem_finish('s3', token, 200, NULL, 'session_bound') FROM r WHERE step = 's3';
-- the new binding is live: the session's own claim answers in_progress
INSERT INTO r SELECT 's2-again', * FROM idempotency.idem_claim('s2', scope => 'session_bound')
RETURNING step, outcome, token;

DELETE FROM idempotency.keys WHERE scope = 'session_bound';

--
-- idem_sweep() resets a pending key whose session is gone (token NULL,
-- unbound; the next claim takes over with attempt + 1), though its lease
-- runs.  The row lock keeps the background worker out, so that the counts
-- are this sweep's.
--
SELECT count(*) AS calls FROM idempotency.idem_sweep();
INSERT INTO r SELECT 'g1', * FROM idempotency.idem_claim('gone', scope => 'session_bound',
       lease => '1 hour', session_bound => true)
RETURNING step, outcome, attempt;
BEGIN;
SELECT count(*) AS locked
  FROM (SELECT 1 FROM idempotency.keys WHERE scope = 'session_bound' FOR UPDATE) l;
SELECT pg_advisory_unlock_all();
SELECT * FROM idempotency.idem_sweep();
SELECT key, status, attempt, token IS NULL AS token_null, owner_session IS NULL AS unbound,
       lease_until > clock_timestamp() AS lease_runs
  FROM idempotency.keys WHERE scope = 'session_bound';
COMMIT;
SELECT idempotency.idem_finish('gone', token, 200, NULL, 'session_bound') FROM r WHERE step = 'g1';
INSERT INTO r SELECT 'g2', * FROM idempotency.idem_claim('gone', scope => 'session_bound',
       session_bound => true)
RETURNING step, outcome, attempt,
          token > (SELECT token FROM r WHERE step = 'g1') AS larger;
SELECT * FROM sb;

-- A key of a live session, under a live lease, is left alone by the sweep.
INSERT INTO r SELECT 'l1', * FROM idempotency.idem_claim('live', scope => 'session_bound',
       lease => '1 hour', session_bound => true)
RETURNING step, outcome, attempt;
SELECT sum AS live_sum FROM sb_state \gset
SELECT count(*) AS calls FROM idempotency.idem_sweep();
SELECT (SELECT sum FROM sb_state) = :'live_sum' AS unchanged, k.token = r.token AS same_token,
       k.owner_session IS NOT NULL AS bound
  FROM idempotency.keys k, r
 WHERE k.scope = 'session_bound' AND k.key = 'live' AND r.step = 'l1';

DELETE FROM idempotency.keys WHERE scope = 'session_bound';

--
-- DISCARD ALL lets the binding go as well.  It cannot run in a transaction
-- block (25001), and then the binding stays.  DISCARD ALL also drops this
-- session's temporary objects, so from here on psql variables carry the
-- facts.
--
SELECT token AS d1 FROM idempotency.idem_claim('discard', scope => 'session_bound',
       session_bound => true) \gset
SELECT owner_session AS b3 FROM idempotency.keys WHERE scope = 'session_bound' AND key = 'discard' \gset
BEGIN;
DISCARD ALL;
ROLLBACK;
SELECT outcome, token FROM idempotency.idem_claim('discard', scope => 'session_bound');
DISCARD ALL;
SELECT outcome, attempt, token > :d1 AS larger, phase
  FROM idempotency.idem_claim('discard', scope => 'session_bound', session_bound => true);
SELECT status, attempt, owner_session > :b3 AS new_binding
  FROM idempotency.keys WHERE scope = 'session_bound' AND key = 'discard';
SELECT idempotency.idem_finish('discard', :d1, 200, NULL, 'session_bound');

DELETE FROM idempotency.keys WHERE scope = 'session_bound';
