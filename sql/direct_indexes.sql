--
-- direct_indexes.sql: a write enters its row into exactly the indexes the
-- row belongs in.  The extension's two partial indexes are judged by their
-- known predicates (keys_owner_session_idx: a session-bound claim still
-- pending; keys_abandoned_idx: a key without a token, as a sweep leaves
-- it), every other index by PostgreSQL's executor.  amcheck's
-- heapallindexed check reads the whole table and fails on any row missing
-- from an index it belongs in.  Leases are ended by moving lease_until and
-- sweep_at into the past, never by waiting for the clock.
--
\set VERBOSITY sqlstate
CREATE EXTENSION IF NOT EXISTS amcheck;
-- the names of the indexes of idempotency.keys that fail amcheck
CREATE FUNCTION pg_temp.broken_indexes() RETURNS text LANGUAGE plpgsql AS $$
DECLARE
	i regclass;
	bad text[] := '{}';
BEGIN
	FOR i IN SELECT indexrelid::regclass FROM pg_index
			  WHERE indrelid = 'idempotency.keys'::regclass ORDER BY 1
	LOOP
		BEGIN
			PERFORM bt_index_check(i, true);
		EXCEPTION WHEN OTHERS THEN
			bad := bad || (i::text || ': ' || SQLERRM);
		END;
	END LOOP;
	RETURN coalesce(nullif(array_to_string(bad, '; '), ''), 'none');
END $$;
-- what the table holds for a key of scope "direct_indexes"
CREATE FUNCTION pg_temp.stored(k text)
RETURNS TABLE (status text, attempt int, has_token boolean, bound boolean)
LANGUAGE sql AS $$
	SELECT status, attempt, token IS NOT NULL, owner_session IS NOT NULL
	  FROM idempotency.keys WHERE scope = 'direct_indexes' AND key = k $$;
-- the keys of the scope each partial index holds, read through the index
CREATE FUNCTION pg_temp.in_partial_indexes()
RETURNS TABLE (idx text, keys text)
LANGUAGE plpgsql AS $$
BEGIN
	SET LOCAL enable_seqscan = off;
	SET LOCAL enable_bitmapscan = off;
	RETURN QUERY
		SELECT 'keys_owner_session_idx', coalesce(string_agg(k.key, ',' ORDER BY k.key), '')
		  FROM idempotency.keys k
		 WHERE k.owner_session IS NOT NULL AND k.scope = 'direct_indexes';
	RETURN QUERY
		SELECT 'keys_abandoned_idx', coalesce(string_agg(k.key, ',' ORDER BY k.key), '')
		  FROM idempotency.keys k
		 WHERE k.token IS NULL AND k.scope = 'direct_indexes';
END $$;
-- the tokens, in a plain table: a session with temporary tables may not
-- write while the table has an index a DBA added (owner_temp_objects)
CREATE TABLE direct_indexes_tokens (key text PRIMARY KEY, token bigint);

-- a fresh claim (in neither partial index), a session-bound one (in
-- keys_owner_session_idx), and one whose lease will end
INSERT INTO direct_indexes_tokens SELECT 'plain', token
  FROM idempotency.idem_claim('plain', '{"n": 1}', 'direct_indexes');
INSERT INTO direct_indexes_tokens SELECT 'bound', token
  FROM idempotency.idem_claim('bound', '{"n": 2}', 'direct_indexes', session_bound => true);
INSERT INTO direct_indexes_tokens SELECT 'stale', token
  FROM idempotency.idem_claim('stale', '{"n": 3}', 'direct_indexes', lease => '1 hour');
SELECT key, (token > 0) AS claimed FROM direct_indexes_tokens ORDER BY key;
SELECT * FROM pg_temp.in_partial_indexes();
SELECT pg_temp.broken_indexes();

-- the finish of a session-bound claim clears owner_session (a HOT update:
-- the old version stays in keys_owner_session_idx, which readers recheck)
SELECT idempotency.idem_finish('bound', token, 200, '{"ok": true}', 'direct_indexes') IS NOT NULL AS finished
  FROM direct_indexes_tokens WHERE key = 'bound';
SELECT * FROM pg_temp.stored('bound');
SELECT * FROM pg_temp.in_partial_indexes();
SELECT pg_temp.broken_indexes();

-- the stale key's lease ends and a sweep resets it: no token, so the
-- sweep's write (not HOT: sweep_at moves) enters it into keys_abandoned_idx
UPDATE idempotency.keys SET lease_until = now() - interval '1 minute',
	   sweep_at = now() - interval '1 minute'
 WHERE scope = 'direct_indexes' AND key = 'stale';
SELECT reset >= 1 AS was_reset FROM idempotency.idem_sweep();
SELECT * FROM pg_temp.stored('stale');
SELECT * FROM pg_temp.in_partial_indexes();
SELECT pg_temp.broken_indexes();

-- a takeover of it gets a token again
SELECT outcome, attempt FROM idempotency.idem_claim('stale', '{"n": 3}', 'direct_indexes');
SELECT * FROM pg_temp.stored('stale');
SELECT pg_temp.broken_indexes();

-- an index a DBA added, partial and on an expression, is the executor's
-- to judge: a row goes into it exactly when its predicate holds
BEGIN;
CREATE INDEX keys_pending_by_key ON idempotency.keys (lower(key))
	WHERE status = 'pending';
SELECT outcome FROM idempotency.idem_claim('Added', '{"n": 4}', 'direct_indexes');
SELECT idempotency.idem_finish('plain', token, 200, scope => 'direct_indexes') IS NOT NULL AS finished
  FROM direct_indexes_tokens WHERE key = 'plain';
SELECT pg_temp.broken_indexes();
SET LOCAL enable_seqscan = off;
SET LOCAL enable_bitmapscan = off;
SELECT key FROM idempotency.keys
 WHERE lower(key) IN ('added', 'plain') AND status = 'pending' AND scope = 'direct_indexes';
ROLLBACK;

-- a partial index of the extension with another predicate is not the
-- extension's: refused (55000), and nothing is written
CREATE FUNCTION pg_temp.err(q text) RETURNS text LANGUAGE plpgsql AS $$
BEGIN
	EXECUTE q;
	RETURN 'ok';
EXCEPTION WHEN OTHERS THEN
	RETURN SQLSTATE || ': ' || SQLERRM;
END $$;
BEGIN;
DROP INDEX idempotency.keys_owner_session_idx;
CREATE INDEX keys_owner_session_idx ON idempotency.keys (owner_session)
	WHERE owner_session > 0;
SELECT pg_temp.err($$SELECT idempotency.idem_claim('refused', scope => 'direct_indexes')$$);
ROLLBACK;
BEGIN;
DROP INDEX idempotency.keys_abandoned_idx;
CREATE INDEX keys_abandoned_idx ON idempotency.keys (scope, created_at)
	WHERE token IS NOT NULL;
SELECT pg_temp.err($$SELECT idempotency.idem_claim('refused', scope => 'direct_indexes')$$);
ROLLBACK;
BEGIN;
DROP INDEX idempotency.keys_abandoned_idx;
CREATE INDEX keys_abandoned_idx ON idempotency.keys (scope, created_at)
	WHERE token IS NULL AND status = 'pending';
SELECT pg_temp.err($$SELECT idempotency.idem_claim('refused', scope => 'direct_indexes')$$);
ROLLBACK;
SELECT count(*) AS refused_stored FROM pg_temp.stored('refused');
SELECT outcome FROM idempotency.idem_claim('after', scope => 'direct_indexes');
SELECT pg_temp.broken_indexes();
DROP TABLE direct_indexes_tokens;
-- leave nothing of this scope pending for the tests after this one
DELETE FROM idempotency.keys WHERE scope = 'direct_indexes';
