--
-- citus_absent.sql: what 1.5 adds for Citus, on a server without it.
-- distribute() raises 55000 with its hint whatever its shard count (the
-- check for Citus comes before the check of the argument), refuses a role
-- without EXECUTE (42501), and changes nothing: the keys, the bindings and
-- the extension's members stay as they were, and no Citus catalog appears.
-- The cluster_stats view answers one row, node 'local', whose columns are
-- those of this database's stats row, and it counts a claim and a finish
-- as stats does.  unbind_scope (PL/pgSQL from 1.5 on) answers true for a
-- binding it deletes, then false; a bound role is confined to its prefix
-- (42501 elsewhere, nothing changes) until its binding is deleted.
--
\set VERBOSITY sqlstate
CREATE ROLE regress_citus_absent_app;
CREATE ROLE regress_citus_absent_other;
GRANT USAGE ON SCHEMA idempotency TO regress_citus_absent_app, regress_citus_absent_other;
CREATE TEMP TABLE r (step text PRIMARY KEY, outcome text, token bigint,
	attempt int, status text, response_code int, response_body jsonb,
	retry_after int, phase text, phase_data jsonb, n serial);
GRANT ALL ON r TO PUBLIC;
GRANT ALL ON SEQUENCE r_n_seq TO PUBLIC;
-- every key of every scope, every binding and the extension's members
CREATE TEMP VIEW citus_absent_state AS
SELECT (SELECT count(*) FROM idempotency.keys) AS keys,
       md5((SELECT coalesce(string_agg(k::text, '|' ORDER BY k.scope, k.key), '')
              FROM idempotency.keys k)
           || (SELECT coalesce(string_agg(b::text, '|' ORDER BY b.role::text), '')
                 FROM idempotency.scope_bindings b)
           || (SELECT string_agg(pg_describe_object(classid, objid, objsubid), '|'
                                 ORDER BY pg_describe_object(classid, objid, objsubid))
                 FROM pg_depend
                WHERE refclassid = 'pg_extension'::regclass AND deptype = 'e'
                  AND refobjid = (SELECT oid FROM pg_extension WHERE extname = 'idempotency'))
           || (SELECT last_value::text FROM idempotency.token_seq)) AS sum;
-- this database's stats row, as jsonb
CREATE TEMP VIEW stats_row AS
SELECT to_jsonb(s) AS j FROM idempotency.stats s WHERE s.database = current_database();

-- a pending and a finished key, so that the checksums cover stored rows
INSERT INTO r SELECT 'pending', * FROM idempotency.idem_claim('pending', '{"x": 1}', 'citus_absent', lease => '1 hour')
RETURNING step, outcome, attempt;
INSERT INTO r SELECT 'done', * FROM idempotency.idem_claim('done', '{"x": 2}', 'citus_absent')
RETURNING step, outcome, attempt;
SELECT idempotency.idem_finish('done', token, 200, '{"ok": true}', 'citus_absent') IS NOT NULL AS finished
  FROM r WHERE step = 'done';
SELECT keys > 0 AS has_keys FROM citus_absent_state;
SELECT sum AS sum0 FROM citus_absent_state \gset
\set unchanged 'SELECT :''LAST_ERROR_SQLSTATE'' AS sqlstate, sum = :''sum0'' AS unchanged FROM citus_absent_state;'

--
-- distribute(): 55000 and its hint, whatever the argument
--
SELECT count(*) AS citus_installed FROM pg_extension WHERE extname = 'citus';
\set VERBOSITY default
\set SHOW_CONTEXT never
SELECT idempotency.distribute();
:unchanged
SELECT idempotency.distribute(4);
:unchanged
SELECT idempotency.distribute(NULL);
:unchanged
-- a shard count distribute() would refuse with 22023 on Citus: the
-- missing extension is reported first
SELECT idempotency.distribute(0);
:unchanged
SELECT idempotency.distribute(-1);
:unchanged
-- in a transaction block too, which it leaves aborted, changing nothing
BEGIN;
SELECT idempotency.distribute(2);
ROLLBACK;
:unchanged
\set VERBOSITY sqlstate
\set SHOW_CONTEXT errors
-- no Citus catalog was created, the tables are still plain tables
SELECT to_regclass('pg_catalog.pg_dist_partition') IS NULL AS no_pg_dist_partition,
       to_regclass('pg_catalog.pg_dist_node') IS NULL AS no_pg_dist_node,
       to_regprocedure('pg_catalog.citus_is_coordinator()') IS NULL AS no_citus_is_coordinator;
SELECT c.relname, c.relkind, c.relpersistence FROM pg_class c
 WHERE c.oid IN ('idempotency.keys'::regclass, 'idempotency.scope_bindings'::regclass)
 ORDER BY c.relname;
-- a role without EXECUTE: 42501, before the function runs
SET ROLE regress_citus_absent_app;
SELECT idempotency.distribute();
RESET ROLE;
:unchanged

--
-- cluster_stats: one row, 'local', this database's stats row
--
SELECT node, database = current_database() AS this_db FROM idempotency.cluster_stats;
SELECT to_jsonb(c) - 'node' = (SELECT j FROM stats_row) AS same_as_stats
  FROM idempotency.cluster_stats c;
-- (NULL counters where the SQL edition runs, which \gset would not keep)
SELECT coalesce(claims, 0) AS claims0, coalesce(finishes, 0) AS finishes0
  FROM idempotency.cluster_stats \gset
INSERT INTO r SELECT 'counted', * FROM idempotency.idem_claim('counted', '{"x": 3}', 'citus_absent')
RETURNING step, outcome, attempt;
SELECT idempotency.idem_finish('counted', token, 201, '{"n": 3}', 'citus_absent') IS NOT NULL AS finished
  FROM r WHERE step = 'counted';
SELECT node, claims - :claims0 AS new_claims, finishes - :finishes0 AS new_finishes
  FROM idempotency.cluster_stats;
SELECT c.claims = (s.j->>'claims')::bigint AS same_claims,
       c.finishes = (s.j->>'finishes')::bigint AS same_finishes,
       to_jsonb(c) - 'node' = s.j AS same_row
  FROM idempotency.cluster_stats c, stats_row s;
-- the key counts too (estimated, maybe NULL, on a table the earlier
-- tests made large: the same either way)
SELECT c.pending IS NOT DISTINCT FROM (s.j->>'pending')::bigint AS same_pending,
       c.succeeded IS NOT DISTINCT FROM (s.j->>'succeeded')::bigint AS same_succeeded,
       c.key_counts_exact IS NOT DISTINCT FROM (s.j->>'key_counts_exact')::boolean AS same_exact
  FROM idempotency.cluster_stats c, stats_row s;
-- a role with USAGE on the schema reads it (PUBLIC has SELECT)
SET ROLE regress_citus_absent_app;
SELECT node, claims - :claims0 AS new_claims FROM idempotency.cluster_stats;
RESET ROLE;

--
-- unbind_scope: true for the binding it deletes, then false
--
SELECT idempotency.bind_scope('regress_citus_absent_app', 'citus_absent:app') AS bound;
SELECT idempotency.bind_scope('regress_citus_absent_other', 'citus_absent:other') AS bound;
SELECT role::text, scope_prefix FROM idempotency.scope_bindings
 WHERE role::text LIKE 'regress_citus_absent%' ORDER BY 1;
SELECT idempotency.unbind_scope('regress_citus_absent_other') AS was_bound;
SELECT idempotency.unbind_scope('regress_citus_absent_other') AS was_bound;
SELECT idempotency.unbind_scope(NULL) IS NULL AS strict_null;
SELECT role::text, scope_prefix FROM idempotency.scope_bindings
 WHERE role::text LIKE 'regress_citus_absent%' ORDER BY 1;
-- a rolled-back unbind leaves the binding
BEGIN;
SELECT idempotency.unbind_scope('regress_citus_absent_app') AS was_bound;
ROLLBACK;
SELECT role::text, scope_prefix FROM idempotency.scope_bindings
 WHERE role::text LIKE 'regress_citus_absent%' ORDER BY 1;

--
-- the bound role: its prefix works, any other scope is refused
--
SET ROLE regress_citus_absent_app;
INSERT INTO r SELECT 'app', * FROM idempotency.idem_claim('k', '{"t": 1}', 'citus_absent:app:orders')
RETURNING step, outcome, attempt;
SELECT idempotency.idem_finish('k', token, 200, '{"t": 1}', 'citus_absent:app:orders') IS NOT NULL AS finished
  FROM r WHERE step = 'app';
RESET ROLE;
SELECT sum AS sum0 FROM citus_absent_state \gset
SET ROLE regress_citus_absent_app;
SELECT * FROM idempotency.idem_claim('k', '{"t": 1}', 'citus_absent');
SELECT * FROM idempotency.idem_claim('k', '{"t": 1}', 'citus_absent:other');
SELECT * FROM idempotency.idem_claim('k', '{"t": 1}');
SELECT * FROM idempotency.idem_lookup('done', 'citus_absent');
SELECT idempotency.idem_finish('pending', token, 200, NULL, 'citus_absent') FROM r WHERE step = 'pending';
RESET ROLE;
:unchanged
-- the unbound role is not confined
SET ROLE regress_citus_absent_other;
SELECT outcome, response_code FROM idempotency.idem_claim('done', '{"x": 2}', 'citus_absent');
RESET ROLE;
-- once unbound, neither is the other one
SELECT idempotency.unbind_scope('regress_citus_absent_app') AS was_bound;
SELECT idempotency.unbind_scope('regress_citus_absent_app') AS was_bound;
SET ROLE regress_citus_absent_app;
SELECT outcome, response_code FROM idempotency.idem_claim('done', '{"x": 2}', 'citus_absent');
RESET ROLE;

-- clean up
SELECT count(*) AS bindings_left FROM idempotency.scope_bindings
 WHERE role::text LIKE 'regress_citus_absent%';
DELETE FROM idempotency.keys WHERE scope LIKE 'citus\_absent%';
REVOKE USAGE ON SCHEMA idempotency FROM regress_citus_absent_app, regress_citus_absent_other;
DROP ROLE regress_citus_absent_app;
DROP ROLE regress_citus_absent_other;
