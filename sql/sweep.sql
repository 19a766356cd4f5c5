--
-- sweep.sql: idem_sweep deletes keys past their retention, resets pending
-- keys whose lease ended (token NULL; the next claim is attempt + 1; the old
-- token is dead), leaves live keys alone, and respects batch_size.
--
-- The background worker sweeps this database too.  To keep the counts
-- exact, this session locks its rows (FOR UPDATE) before they expire and
-- sweeps in that same transaction: the worker skips rows others have
-- locked, this session's own sweep does not.
--
\set VERBOSITY sqlstate
CREATE TEMP TABLE r (step text PRIMARY KEY, outcome text, token bigint,
	attempt int, status text, response_code int, response_body jsonb,
	retry_after int, phase text, phase_data jsonb, n serial);

-- batch_size must be positive (22023); NULL means the GUC
SELECT * FROM idempotency.idem_sweep(0);
SELECT * FROM idempotency.idem_sweep(-1);
-- start from a clean slate: whatever expired earlier in this database
SELECT count(*) AS calls FROM idempotency.idem_sweep(NULL);

-- e1..e3 succeeded, e4 failed: kept 1 s
-- e5: pending, lease 1 s, retention 1 s (expired, so deleted, not reset)
-- s1, s2: pending, lease 1 s, retention 1 day (stale: reset)
-- live: pending, lease 1 hour, retention 1 s (kept while the lease lives)
-- kept: succeeded, kept 1 hour
INSERT INTO r SELECT key, c.* FROM unnest(ARRAY['e1', 'e2', 'e3', 'e4']) key,
       idempotency.idem_claim(key, '{"e": true}', 'sweep') c;
SELECT count(*) FILTER (WHERE idempotency.idem_finish(step, token, 200, NULL, 'sweep',
           CASE step WHEN 'e4' THEN 'failed' ELSE 'succeeded' END, '1 second') IS NOT NULL) AS finished
  FROM r WHERE step IN ('e1', 'e2', 'e3', 'e4');
INSERT INTO r SELECT 'e5', * FROM idempotency.idem_claim('e5', scope => 'sweep',
       lease => '1 second', retention => '1 second')
RETURNING step, outcome, attempt;
INSERT INTO r SELECT 's1', * FROM idempotency.idem_claim('s1', '{"s": 1}', 'sweep', lease => '1 second')
RETURNING step, outcome, attempt;
INSERT INTO r SELECT 's2', * FROM idempotency.idem_claim('s2', '{"s": 2}', 'sweep', lease => '1 second')
RETURNING step, outcome, attempt;
INSERT INTO r SELECT 'live', * FROM idempotency.idem_claim('live', scope => 'sweep',
       lease => '1 hour', retention => '1 second')
RETURNING step, outcome, attempt;
INSERT INTO r SELECT 'kept', * FROM idempotency.idem_claim('kept', scope => 'sweep')
RETURNING step, outcome, attempt;
SELECT idempotency.idem_finish('kept', token, 200, '{"kept": true}', 'sweep', retention => '1 hour') IS NOT NULL AS finished
  FROM r WHERE step = 'kept';
SELECT token AS s1 FROM r WHERE step = 's1' \gset
SELECT token AS s2 FROM r WHERE step = 's2' \gset
SELECT token AS live FROM r WHERE step = 'live' \gset
SELECT key, status, attempt FROM idempotency.keys WHERE scope = 'sweep' ORDER BY key;

BEGIN;
SELECT count(*) AS locked FROM (SELECT 1 FROM idempotency.keys WHERE scope = 'sweep' FOR UPDATE) l;
SELECT pg_sleep(1.1);
SELECT * FROM idempotency.idem_sweep();
COMMIT;

-- expired keys are gone; stale pending ones are reset (token NULL, same
-- attempt); the live and the kept key are untouched
SELECT key, status, attempt, token IS NULL AS token_null FROM idempotency.keys
 WHERE scope = 'sweep' ORDER BY key;
SELECT token = :live AS live_token_kept FROM idempotency.keys WHERE scope = 'sweep' AND key = 'live';
SELECT status, attempt, response_code FROM idempotency.idem_lookup('s1', 'sweep');
-- nothing left to do
SELECT * FROM idempotency.idem_sweep();

-- the reset key's old token is dead: 55006 for finish, extend, release, and
-- the key is unchanged
SELECT k::text AS s1_row FROM idempotency.keys k WHERE k.scope = 'sweep' AND k.key = 's1' \gset
SELECT idempotency.idem_finish('s1', :s1, 200, '{"from": "old"}', 'sweep');
SELECT idempotency.idem_extend('s1', :s1, '1 hour', 'sweep');
SELECT idempotency.idem_release('s1', :s1, 'sweep');
SELECT k::text = :'s1_row' AS unchanged FROM idempotency.keys k
 WHERE k.scope = 'sweep' AND k.key = 's1';
-- the fingerprint survives the reset: a different request is a mismatch
INSERT INTO r SELECT 's1-mismatch', * FROM idempotency.idem_claim('s1', '{"s": 99}', 'sweep')
RETURNING step, outcome, token, attempt;
-- the next matching claim takes over: attempt 2, a larger token
INSERT INTO r SELECT 's1-takeover', * FROM idempotency.idem_claim('s1', '{"s": 1}', 'sweep')
RETURNING step, outcome, attempt, token > :s1 AS larger_token;
INSERT INTO r SELECT 's2-takeover', * FROM idempotency.idem_claim('s2', '{"s": 2}', 'sweep')
RETURNING step, outcome, attempt, token > :s2 AS larger_token;
SELECT key, status, attempt, token IS NOT NULL AS has_token FROM idempotency.keys
 WHERE scope = 'sweep' AND key IN ('s1', 's2') ORDER BY key;
-- the old token still dead; the new one finishes
SELECT idempotency.idem_finish('s1', :s1, 200, '{"from": "old"}', 'sweep');
SELECT idempotency.idem_finish('s1', token, 200, '{"from": "new"}', 'sweep') IS NOT NULL AS finished
  FROM r WHERE step = 's1-takeover';
SELECT status, attempt, response_body FROM idempotency.idem_lookup('s1', 'sweep');
-- the old token now meets a key finished by another token
SELECT idempotency.idem_finish('s1', :s1, 200, '{"from": "old"}', 'sweep');
DELETE FROM idempotency.keys WHERE scope = 'sweep';

--
-- batch_size: at most batch_size keys of each kind per call; a full batch
-- tells the caller to call again.
--
INSERT INTO r SELECT 'b' || g, c.* FROM generate_series(1, 5) g,
       idempotency.idem_claim('b' || g, scope => 'sweep-batch') c;
SELECT count(*) FILTER (WHERE idempotency.idem_finish(step, token, 200, NULL, 'sweep-batch',
           retention => '1 second') IS NOT NULL) AS finished
  FROM r WHERE step IN ('b1', 'b2', 'b3', 'b4', 'b5');
INSERT INTO r SELECT 'c' || g, c.* FROM generate_series(1, 3) g,
       idempotency.idem_claim('c' || g, scope => 'sweep-batch', lease => '1 second') c;
SELECT count(*) AS rows FROM idempotency.keys WHERE scope = 'sweep-batch';
BEGIN;
SELECT count(*) AS locked FROM (SELECT 1 FROM idempotency.keys WHERE scope = 'sweep-batch' FOR UPDATE) l;
SELECT pg_sleep(1.1);
-- the caller's loop: call again while either kind came back full
CREATE TEMP TABLE calls (n int, expired bigint, reset bigint);
DO $$
DECLARE
	e bigint;
	r bigint;
BEGIN
	FOR i IN 1..20 LOOP
		SELECT * INTO e, r FROM idempotency.idem_sweep(2);
		INSERT INTO calls VALUES (i, e, r);
		EXIT WHEN e < 2 AND r < 2;
	END LOOP;
END
$$;
-- no call did more than 2 of a kind; when the loop stopped, all 5 expired
-- keys were deleted and all 3 stale ones reset
SELECT bool_and(expired <= 2 AND reset <= 2) AS at_most_batch,
       bool_or(expired = 2 OR reset = 2) AS some_full_batch,
       sum(expired) AS expired, sum(reset) AS reset,
       count(*) BETWEEN 3 AND 5 AS calls
  FROM calls;
SELECT count(*) AS rows, count(*) FILTER (WHERE token IS NULL) AS reset
  FROM idempotency.keys WHERE scope = 'sweep-batch';
-- one more call finds nothing
SELECT * FROM idempotency.idem_sweep(2);
COMMIT;
SELECT key, status, attempt, token IS NULL AS token_null FROM idempotency.keys
 WHERE scope = 'sweep-batch' ORDER BY key;
DELETE FROM idempotency.keys WHERE scope = 'sweep-batch';

--
-- Expired keys are deleted straight from the heap unless the table has
-- triggers or rules: then the executor's DELETE runs, so that a user's
-- trigger or rule (or a foreign key referencing the table) still sees every
-- delete.  Each path in one transaction (the worker cannot see these rows).
--
-- n keys k1..kn in scope, claimed and finished with a 1 ms retention in the
-- current transaction; returns how many were finished
CREATE FUNCTION pg_temp.finish_expiring(p_scope text, n int) RETURNS bigint
LANGUAGE sql AS $$
	SELECT count(idempotency.idem_finish('k' || g, c.token, 200, NULL, p_scope,
	                                     retention => '1 millisecond'))
	  FROM generate_series(1, n) g,
	       LATERAL idempotency.idem_claim('k' || g, scope => p_scope) c
$$;
BEGIN;
SELECT pg_temp.finish_expiring('sweep-direct', 3) AS finished;
SELECT pg_sleep(0.01);
SELECT * FROM idempotency.idem_sweep();
SELECT count(*) AS rows FROM idempotency.keys WHERE scope = 'sweep-direct';
COMMIT;

-- A session with temporary tables may not write through triggers or rules
-- (owner_search_path tests why): this one's are done with.
DROP TABLE r, calls;
CREATE TABLE sweep_log (scope text, key text, status text);
-- the table's triggers and rules write here with its owner's rights
DO $$ BEGIN EXECUTE format('GRANT SELECT, INSERT ON sweep_log TO %s', (SELECT c.relowner::regrole FROM pg_class c
    WHERE c.oid = 'idempotency.keys'::regclass)); END $$;
CREATE FUNCTION sweep_log_delete() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN INSERT INTO public.sweep_log VALUES (OLD.scope, OLD.key, OLD.status); RETURN OLD; END $$;
BEGIN;
CREATE TRIGGER keys_sweep_log AFTER DELETE ON idempotency.keys
	FOR EACH ROW EXECUTE FUNCTION sweep_log_delete();
SELECT pg_temp.finish_expiring('sweep-trigger', 3) AS finished;
SELECT pg_sleep(0.01);
SELECT * FROM idempotency.idem_sweep();
SELECT count(*) AS rows FROM idempotency.keys WHERE scope = 'sweep-trigger';
SELECT * FROM sweep_log ORDER BY key;
ROLLBACK;
-- a DELETE rule likewise
BEGIN;
CREATE RULE keys_sweep_log AS ON DELETE TO idempotency.keys
	DO ALSO INSERT INTO sweep_log VALUES (OLD.scope, OLD.key, OLD.status);
SELECT pg_temp.finish_expiring('sweep-rule', 2) AS finished;
SELECT pg_sleep(0.01);
SELECT * FROM idempotency.idem_sweep();
SELECT count(*) AS rows FROM idempotency.keys WHERE scope = 'sweep-rule';
SELECT * FROM sweep_log ORDER BY key;
ROLLBACK;
DROP TABLE sweep_log;
DROP FUNCTION sweep_log_delete();
