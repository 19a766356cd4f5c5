/* idempotency--1.7--1.8.sql: update the idempotency extension from 1.7 to 1.8 */

-- complain if script is sourced in psql, rather than via ALTER EXTENSION
\echo Use "ALTER EXTENSION idempotency UPDATE TO '1.8'" to load this file. \quit

/*
 * 1.8 adds completers: a claim can keep its request with the key (a last
 * argument keep_request of idem_claim), idem_claim_abandoned takes over
 * the keys whose attempt was abandoned and returns what a completer needs
 * to finish them, sweeps notify idempotency_abandoned with the scope of
 * the keys they reset, and the stats views count the keys taken over that
 * way in a last column.  The table's new column is NULL in every stored
 * row (no request kept), so adding it rewrites nothing; the new partial
 * index holds the pending keys a sweep has reset, which are few.
 */
-- IF NOT EXISTS: where Citus distributes the table, the coordinator's update
-- adds the column and index on every node before Citus runs this script there
ALTER TABLE idempotency.keys ADD COLUMN IF NOT EXISTS request jsonb;
-- Citus passes a CREATE INDEX on to the shards as the text it was given,
-- which in an extension script is the whole script: EXECUTE gives it the
-- statement alone
DO $$
BEGIN
	EXECUTE 'CREATE INDEX IF NOT EXISTS keys_abandoned_idx '
		 || 'ON idempotency.keys (scope, created_at) WHERE token IS NULL';
END
$$;

/*
 * A function's arguments and result columns cannot be changed in place:
 * idem_claim, stats_counters and cluster_stats_rows are each created again
 * under a passing name, take over the old one's owner and privileges,
 * replace it and take its name.  An administrator's grants and revokes
 * carry over unchanged (each grant made by its own grantor, in the order
 * of the old ACL); grants made in an extension script would be recorded as
 * the extension's initial privileges, which pg_dump does not dump, so that
 * record is removed again (with the role dependencies PostgreSQL 17 and
 * later keep beside it).  A view or a SQL function with a BEGIN ATOMIC
 * body that uses one of the old functions makes its DROP fail with
 * PostgreSQL's dependency error (2BP01) and the whole update rolls back,
 * leaving 1.7 as it was: drop those objects, update, create them again.
 */
CREATE FUNCTION idempotency.update_take_over(old_fn regprocedure,
											 new_fn regprocedure)
RETURNS void
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
	my_role	CONSTANT text := pg_catalog.current_setting('role');
	owner	name;
	acl		aclitem[];
	item	record;
BEGIN
	SELECT pg_catalog.pg_get_userbyid(p.proowner), p.proacl INTO owner, acl
	  FROM pg_catalog.pg_proc p WHERE p.oid OPERATOR(pg_catalog.=) old_fn;
	EXECUTE pg_catalog.format('ALTER FUNCTION %s OWNER TO %I', new_fn, owner);
	IF acl IS NULL THEN
		RETURN;
	END IF;

	EXECUTE pg_catalog.format('REVOKE ALL ON FUNCTION %s FROM PUBLIC, %I',
							  new_fn, owner);
	FOR item IN
		SELECT pg_catalog.pg_get_userbyid(a.grantor) AS grantor,
			   CASE WHEN a.grantee OPERATOR(pg_catalog.=) 0 THEN 'PUBLIC'
					ELSE pg_catalog.quote_ident(pg_catalog.pg_get_userbyid(a.grantee))
			   END AS grantee,
			   a.is_grantable
		  FROM pg_catalog.aclexplode(acl) WITH ORDINALITY AS a
		 ORDER BY a.ordinality
	LOOP
		-- a grant someone made with the grant option the owner gave them
		IF item.grantor OPERATOR(pg_catalog.<>) owner THEN
			PERFORM pg_catalog.set_config('role', item.grantor, false);
		END IF;
		EXECUTE pg_catalog.format('GRANT EXECUTE ON FUNCTION %s TO %s%s',
								  new_fn, item.grantee,
								  CASE WHEN item.is_grantable
								  THEN ' WITH GRANT OPTION' ELSE '' END);
		IF item.grantor OPERATOR(pg_catalog.<>) owner THEN
			PERFORM pg_catalog.set_config('role', my_role, false);
		END IF;
	END LOOP;

	DELETE FROM pg_catalog.pg_init_privs i
	 WHERE i.classoid OPERATOR(pg_catalog.=) 'pg_catalog.pg_proc'::regclass
	   AND i.objoid OPERATOR(pg_catalog.=) new_fn;
	DELETE FROM pg_catalog.pg_shdepend d
	 WHERE d.dbid OPERATOR(pg_catalog.=)
			(SELECT db.oid FROM pg_catalog.pg_database db
			  WHERE db.datname OPERATOR(pg_catalog.=) pg_catalog.current_database())
	   AND d.classid OPERATOR(pg_catalog.=) 'pg_catalog.pg_proc'::regclass
	   AND d.objid OPERATOR(pg_catalog.=) new_fn
	   AND d.objsubid OPERATOR(pg_catalog.=) 0
	   AND d.deptype OPERATOR(pg_catalog.=) 'i';
END
$fn$;

-- idem_claim: a last argument, keep_request
CREATE FUNCTION idempotency.idem_claim_1_8(
	key			text,
	request		jsonb		DEFAULT NULL,
	scope		text		DEFAULT '',
	lease		interval	DEFAULT NULL,
	retention	interval	DEFAULT NULL,
	wait		interval	DEFAULT '0',
	session_bound boolean	DEFAULT false,
	remember	interval	DEFAULT NULL,
	keep_request boolean	DEFAULT false)
RETURNS SETOF idempotency.claim_result
AS 'MODULE_PATHNAME', 'idem_claim'
LANGUAGE C VOLATILE PARALLEL UNSAFE ROWS 1;
SELECT idempotency.update_take_over(
	'idempotency.idem_claim(text,jsonb,text,interval,interval,interval,boolean,interval)',
	'idempotency.idem_claim_1_8(text,jsonb,text,interval,interval,interval,boolean,interval,boolean)');
DROP FUNCTION idempotency.idem_claim(text, jsonb, text, interval, interval,
									 interval, boolean, interval);
ALTER FUNCTION idempotency.idem_claim_1_8(text, jsonb, text, interval,
										  interval, interval, boolean,
										  interval, boolean)
	RENAME TO idem_claim;

/*
 * Replace a view of the extension in place with "definition" (a CREATE OR
 * REPLACE VIEW statement): its owner and privileges stay, and the options
 * an administrator set on it, which CREATE OR REPLACE VIEW resets, are put
 * back.
 */
CREATE FUNCTION idempotency.update_replace_view(view regclass, definition text)
RETURNS void
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
	options text[];
BEGIN
	SELECT c.reloptions INTO options FROM pg_catalog.pg_class c
	 WHERE c.oid OPERATOR(pg_catalog.=) view;
	EXECUTE definition;
	IF options IS NOT NULL THEN
		EXECUTE pg_catalog.format('ALTER VIEW %s SET (%s)', view,
								  pg_catalog.array_to_string(options, ', '));
	END IF;
END
$fn$;

-- stats_counters: a last column, abandoned_takeovers
CREATE FUNCTION idempotency.stats_counters_1_8(
	OUT dbid oid, OUT claims bigint, OUT takeovers bigint, OUT replays bigint,
	OUT in_progress bigint, OUT mismatches bigint, OUT finishes bigint,
	OUT releases bigint, OUT expired bigint, OUT reset bigint,
	OUT last_sweep_at timestamptz, OUT last_sweep_ms double precision,
	OUT checkpoints bigint, OUT abandoned_takeovers bigint)
RETURNS SETOF record
AS 'MODULE_PATHNAME', 'idem_stats_counters'
LANGUAGE C VOLATILE PARALLEL SAFE;
SELECT idempotency.update_take_over('idempotency.stats_counters()',
									'idempotency.stats_counters_1_8()');

/*
 * The stats view gains its last column, abandoned_takeovers; the other
 * columns keep their names, types and order, so it is replaced in place:
 * its owner and privileges stay, and options an administrator set on it
 * (which CREATE OR REPLACE VIEW resets) are put back.  It is replaced once
 * more after the rename, so that its definition names the function as a
 * fresh install's does.
 */
SELECT idempotency.update_replace_view('idempotency.stats', $view$
CREATE OR REPLACE VIEW idempotency.stats AS
SELECT d.datname AS database,
	   c.claims, c.takeovers, c.replays, c.in_progress, c.mismatches,
	   c.finishes, c.releases, c.expired, c.reset,
	   c.last_sweep_at, c.last_sweep_ms,
	   k.pending, k.succeeded, k.failed, k.exact AS key_counts_exact,
	   c.checkpoints, k.remembered, c.abandoned_takeovers
  FROM pg_catalog.pg_database d
  LEFT JOIN idempotency.stats_counters_1_8() c
	ON c.dbid OPERATOR(pg_catalog.=) d.oid
  LEFT JOIN idempotency.stats_key_counts() k
	ON d.datname OPERATOR(pg_catalog.=) pg_catalog.current_database()
 WHERE d.datname OPERATOR(pg_catalog.=) pg_catalog.current_database()
	OR c.dbid IS NOT NULL
$view$);
DROP FUNCTION idempotency.stats_counters();
ALTER FUNCTION idempotency.stats_counters_1_8() RENAME TO stats_counters;
SELECT idempotency.update_replace_view('idempotency.stats', $view$
CREATE OR REPLACE VIEW idempotency.stats AS
SELECT d.datname AS database,
	   c.claims, c.takeovers, c.replays, c.in_progress, c.mismatches,
	   c.finishes, c.releases, c.expired, c.reset,
	   c.last_sweep_at, c.last_sweep_ms,
	   k.pending, k.succeeded, k.failed, k.exact AS key_counts_exact,
	   c.checkpoints, k.remembered, c.abandoned_takeovers
  FROM pg_catalog.pg_database d
  LEFT JOIN idempotency.stats_counters() c
	ON c.dbid OPERATOR(pg_catalog.=) d.oid
  LEFT JOIN idempotency.stats_key_counts() k
	ON d.datname OPERATOR(pg_catalog.=) pg_catalog.current_database()
 WHERE d.datname OPERATOR(pg_catalog.=) pg_catalog.current_database()
	OR c.dbid IS NOT NULL
$view$);

/*
 * cluster_stats_rows() returns the stats view's columns after the node's
 * name, so it gains abandoned_takeovers too, and so does the cluster_stats
 * view over it (replaced in place as the stats view is).
 */
CREATE FUNCTION idempotency.cluster_stats_rows_1_8()
RETURNS TABLE (node text, database name, claims bigint, takeovers bigint,
			   replays bigint, in_progress bigint, mismatches bigint,
			   finishes bigint, releases bigint, expired bigint,
			   reset bigint, last_sweep_at timestamptz,
			   last_sweep_ms double precision, pending bigint,
			   succeeded bigint, failed bigint, key_counts_exact boolean,
			   checkpoints bigint, remembered bigint,
			   abandoned_takeovers bigint)
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
	coordinator boolean := false;
BEGIN
	-- a separate statement: without Citus, citus_is_coordinator() is unknown
	IF EXISTS (SELECT FROM pg_catalog.pg_extension e
			   WHERE e.extname OPERATOR(pg_catalog.=) 'citus') THEN
		EXECUTE 'SELECT pg_catalog.citus_is_coordinator()' INTO coordinator;
	END IF;
	IF NOT coordinator THEN
		RETURN QUERY
			SELECT 'local'::text, s.*
			  FROM idempotency.stats s
			 WHERE s.database OPERATOR(pg_catalog.=) pg_catalog.current_database();
		RETURN;
	END IF;
	RETURN QUERY EXECUTE
		'SELECT n.nodename OPERATOR(pg_catalog.||) '':'' OPERATOR(pg_catalog.||) n.nodeport, s.*
		   FROM pg_catalog.run_command_on_all_nodes(
				''SELECT pg_catalog.row_to_json(s) FROM idempotency.stats s
				   WHERE s.database OPERATOR(pg_catalog.=) pg_catalog.current_database()'') r
		   JOIN pg_catalog.pg_dist_node n
			 ON n.nodeid OPERATOR(pg_catalog.=) r.nodeid,
		   LATERAL pg_catalog.json_populate_record(NULL::idempotency.stats,
			   CASE WHEN r.success THEN r.result::pg_catalog.json
			   ELSE idempotency.cluster_stats_failed(n.nodename, n.nodeport, r.result) END) s
		  ORDER BY n.groupid, n.nodeid';
END;
$$;

SELECT idempotency.update_take_over('idempotency.cluster_stats_rows()',
									'idempotency.cluster_stats_rows_1_8()');
SELECT idempotency.update_replace_view('idempotency.cluster_stats', $view$
CREATE OR REPLACE VIEW idempotency.cluster_stats AS
SELECT * FROM idempotency.cluster_stats_rows_1_8()
$view$);
DROP FUNCTION idempotency.cluster_stats_rows();
ALTER FUNCTION idempotency.cluster_stats_rows_1_8() RENAME TO cluster_stats_rows;
-- once more under the function's own name, which the view's columns are
-- qualified with, as in a fresh install
SELECT idempotency.update_replace_view('idempotency.cluster_stats', $view$
CREATE OR REPLACE VIEW idempotency.cluster_stats AS
SELECT * FROM idempotency.cluster_stats_rows()
$view$);

DROP FUNCTION idempotency.update_take_over(regprocedure, regprocedure);
DROP FUNCTION idempotency.update_replace_view(regclass, text);

/*
 * A completer's claim: take over up to max_keys keys of the scope whose
 * attempt was abandoned (its lease ended, or its session-bound owner's
 * session), oldest first, each as a claim's takeover, with the request the
 * key was claimed with (when it was kept) and its last recovery point.
 */
CREATE FUNCTION idempotency.idem_claim_abandoned(
	scope		text		DEFAULT '',
	max_keys	integer		DEFAULT 1,
	lease		interval	DEFAULT NULL)
RETURNS TABLE (key text, token bigint, attempt integer, request jsonb,
			   phase text, phase_data jsonb)
AS 'MODULE_PATHNAME', 'idem_claim_abandoned'
LANGUAGE C VOLATILE PARALLEL UNSAFE ROWS 10;

/*
 * Where Citus distributes idempotency.keys, idem_claim (created anew
 * above) and idem_claim_abandoned are not delegated by scope yet: Citus
 * passes this update on to the workers only after it ran here, and a
 * function can be distributed only once every node has it.  Running
 * distribute() again on the coordinator, once every node is updated,
 * delegates them as it did the old ones (docs/scale-out.md, updating).
 */
