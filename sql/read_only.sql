--
-- read_only.sql: in a READ ONLY transaction (SET TRANSACTION READ ONLY, or
-- default_transaction_read_only = on) every function but idem_lookup and
-- the stats views raises read_only_sql_transaction (25006) before it reads
-- anything, on both write paths (the direct writer, and the SQL statements
-- used when a trigger is on the table), and no stored row changes.  The
-- administrator's functions that write (bind_scope, unbind_scope,
-- distribute) are refused the same way; stats_reset, which only zeroes
-- this server's counters in shared memory, and idem_version answer, as
-- pg_stat_reset and version() do.
--
-- Counts are exact only while nobody else sweeps this database: run with
-- the background sweeper off (idempotency.sweep_interval = 0).
--
\set VERBOSITY sqlstate

SELECT count(*) AS calls FROM idempotency.idem_sweep(NULL);

CREATE TABLE ro_tokens (key text PRIMARY KEY, token bigint);
INSERT INTO ro_tokens
SELECT k, c.token FROM unnest(ARRAY['p1', 'p2', 'stale']) k,
       LATERAL idempotency.idem_claim(k, scope => 'read-only',
                                      lease => CASE k WHEN 'stale' THEN '1 millisecond'
                                                      ELSE '1 hour' END::interval) c;
SELECT idempotency.idem_finish('f1', c.token, 200, '{"f": 1}', 'read-only') IS NOT NULL AS finished
  FROM idempotency.idem_claim('f1', scope => 'read-only') c;
SELECT count(*) AS waited FROM idempotency.keys k, pg_sleep_until(k.lease_until)
 WHERE k.scope = 'read-only' AND k.key = 'stale';
CREATE TABLE ro_before AS SELECT * FROM idempotency.keys WHERE scope = 'read-only';

-- each call in its own READ ONLY transaction (by "how"), as "SQLSTATE"
CREATE FUNCTION pg_temp.try(p_sql text) RETURNS text LANGUAGE plpgsql AS $$
DECLARE
	st text;
BEGIN
	EXECUTE p_sql;
	RETURN 'no error';
EXCEPTION WHEN OTHERS THEN
	GET STACKED DIAGNOSTICS st = RETURNED_SQLSTATE;
	RETURN st;
END $$;
CREATE TABLE ro_calls (n int, call text);
INSERT INTO ro_calls VALUES
 (1, $$SELECT * FROM idempotency.idem_claim('new', scope => 'read-only')$$),
 (2, $$SELECT * FROM idempotency.idem_claim('f1', scope => 'read-only')$$),
 (3, $$SELECT * FROM idempotency.idem_claim('p1', scope => 'read-only')$$),
 (4, $$SELECT * FROM idempotency.idem_claim('stale', scope => 'read-only')$$),
 (5, $$SELECT * FROM idempotency.idem_claim_many('{new,f1,stale}', scope => 'read-only')$$),
 (6, $$SELECT idempotency.idem_finish('p1', (SELECT token FROM ro_tokens WHERE key = 'p1'), 200, NULL, 'read-only')$$),
 (7, $$SELECT idempotency.idem_finish('p1', 1, 200, NULL, 'read-only')$$),
 (8, $$SELECT idempotency.idem_finish('absent', 1, 200, NULL, 'read-only')$$),
 (9, $$SELECT * FROM idempotency.idem_finish_many('{p1,p2}', (SELECT array_agg(token ORDER BY key) FROM ro_tokens WHERE key IN ('p1', 'p2')), scope => 'read-only')$$),
 (10, $$SELECT idempotency.idem_extend('p1', (SELECT token FROM ro_tokens WHERE key = 'p1'), '2 hours', 'read-only')$$),
 (11, $$SELECT idempotency.idem_release('p2', (SELECT token FROM ro_tokens WHERE key = 'p2'), 'read-only')$$),
 (12, $$SELECT idempotency.idem_checkpoint('p1', (SELECT token FROM ro_tokens WHERE key = 'p1'), 'step', '{}', 'read-only')$$),
 (13, $$SELECT * FROM idempotency.idem_sweep()$$),
 (14, $$SELECT * FROM idempotency.idem_lookup('f1', 'read-only')$$),
 (15, $$SELECT * FROM idempotency.stats$$),
 (16, $$SELECT idempotency.bind_scope('regress_read_only', 'ro:')$$),
 (17, $$SELECT idempotency.unbind_scope('regress_read_only')$$),
 (18, $$SELECT idempotency.distribute()$$),
 (19, $$SELECT * FROM idempotency.cluster_stats$$),
 (20, $$SELECT idempotency.stats_reset()$$),
 (21, $$SELECT idempotency.idem_version()$$);
CREATE ROLE regress_read_only;
SELECT idempotency.bind_scope('regress_read_only', 'ro-before:');
CREATE TABLE ro_bindings_before AS SELECT * FROM idempotency.scope_bindings;

-- a temporary table takes the results: it is writable in a read-only
-- transaction
CREATE TEMP TABLE ro_results (path text, how text, n int, result text);

-- the direct path: the table as the extension made it
BEGIN READ ONLY;
INSERT INTO ro_results SELECT 'direct', 'BEGIN READ ONLY', n, pg_temp.try(call) FROM ro_calls;
COMMIT;
SET default_transaction_read_only = on;
INSERT INTO ro_results SELECT 'direct', 'default_transaction_read_only', n, pg_temp.try(call) FROM ro_calls;
SET default_transaction_read_only = off;

-- the SQL path: a trigger on the table
CREATE FUNCTION ro_noop() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN RETURN COALESCE(NEW, OLD); END $$;
CREATE TRIGGER ro_noop BEFORE INSERT OR UPDATE OR DELETE ON idempotency.keys
	FOR EACH ROW EXECUTE FUNCTION ro_noop();
BEGIN READ ONLY;
INSERT INTO ro_results SELECT 'trigger', 'BEGIN READ ONLY', n, pg_temp.try(call) FROM ro_calls;
COMMIT;
SET default_transaction_read_only = on;
INSERT INTO ro_results SELECT 'trigger', 'default_transaction_read_only', n, pg_temp.try(call) FROM ro_calls;
SET default_transaction_read_only = off;
DROP TRIGGER ro_noop ON idempotency.keys;

-- every call, on both paths and both ways: the same answer
SELECT c.n, regexp_replace(split_part(c.call, '(', 1), '^SELECT (\* FROM )?idempotency\.', '') AS function,
       string_agg(DISTINCT r.result, ', ') AS results, count(r.*) AS runs
  FROM ro_calls c LEFT JOIN ro_results r USING (n)
 GROUP BY c.n, c.call ORDER BY c.n;

-- nothing changed
SELECT count(*) AS changed FROM (
	(SELECT * FROM ro_before EXCEPT SELECT * FROM idempotency.keys WHERE scope = 'read-only')
	UNION ALL
	(SELECT * FROM idempotency.keys WHERE scope = 'read-only' EXCEPT SELECT * FROM ro_before)) d;

SELECT count(*) AS bindings_changed FROM (
	(SELECT * FROM ro_bindings_before EXCEPT SELECT * FROM idempotency.scope_bindings)
	UNION ALL
	(SELECT * FROM idempotency.scope_bindings EXCEPT SELECT * FROM ro_bindings_before)) d;

-- outside a read-only transaction the same calls go through (distribute()
-- then says what it lacks: Citus)
SELECT n, pg_temp.try(call) AS result FROM ro_calls WHERE n IN (1, 13, 16, 17, 18) ORDER BY n;

SELECT idempotency.unbind_scope('regress_read_only');
DROP ROLE regress_read_only;
DROP TABLE ro_tokens, ro_before, ro_calls, ro_bindings_before;
DROP FUNCTION ro_noop();
DELETE FROM idempotency.keys WHERE scope = 'read-only';
