/* idempotency--1.6--1.7.sql: update the idempotency extension from 1.6 to 1.7 */

-- complain if script is sourced in psql, rather than via ALTER EXTENSION
\echo Use "ALTER EXTENSION idempotency UPDATE TO '1.7'" to load this file. \quit

/*
 * 1.7 adds remembered keys: a finished key can be remembered for a while
 * after its retention (a last argument "remember" of idem_claim,
 * idem_finish and idem_finish_many, and the setting idempotency.remember),
 * the claim of such a key answers the new outcome "expired" instead of
 * running again, idem_lookup shows remembered_until as its last column,
 * idem_forget removes a finished key on purpose, and the stats views count
 * remembered keys in a last column.  The table's new column is NULL in
 * every stored row, which is what a key that is not remembered has, so
 * adding it rewrites nothing and every key keeps behaving as in 1.6.
 */
-- IF NOT EXISTS: where Citus distributes the table, the coordinator's update
-- adds the column on every node before Citus runs this script there
ALTER TABLE idempotency.keys ADD COLUMN IF NOT EXISTS remember interval;

/*
 * A function's arguments and result columns cannot be changed in place:
 * idem_claim, idem_finish, idem_finish_many, idem_lookup, stats_key_counts
 * and cluster_stats_rows are each created again under a passing name, take
 * over the old one's owner and privileges, replace it and take its name.
 * An administrator's grants and revokes carry over unchanged (each grant
 * made by its own grantor, in the order of the old ACL); grants made in an
 * extension script would be recorded as the extension's initial
 * privileges, which pg_dump does not dump, so that record is removed again
 * (with the role dependencies PostgreSQL 17 and later keep beside it).  A
 * view or a SQL function with a BEGIN ATOMIC body that uses one of the old
 * functions makes its DROP fail with PostgreSQL's dependency error (2BP01)
 * and the whole update rolls back, leaving 1.6 as it was: drop those
 * objects, update, create them again.
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

-- idem_claim: a last argument, remember
CREATE FUNCTION idempotency.idem_claim_1_7(
	key			text,
	request		jsonb		DEFAULT NULL,
	scope		text		DEFAULT '',
	lease		interval	DEFAULT NULL,
	retention	interval	DEFAULT NULL,
	wait		interval	DEFAULT '0',
	session_bound boolean	DEFAULT false,
	remember	interval	DEFAULT NULL)
RETURNS SETOF idempotency.claim_result
AS 'MODULE_PATHNAME', 'idem_claim'
LANGUAGE C VOLATILE PARALLEL UNSAFE ROWS 1;
SELECT idempotency.update_take_over(
	'idempotency.idem_claim(text,jsonb,text,interval,interval,interval,boolean)',
	'idempotency.idem_claim_1_7(text,jsonb,text,interval,interval,interval,boolean,interval)');
DROP FUNCTION idempotency.idem_claim(text, jsonb, text, interval, interval,
									 interval, boolean);
ALTER FUNCTION idempotency.idem_claim_1_7(text, jsonb, text, interval,
										  interval, interval, boolean, interval)
	RENAME TO idem_claim;

-- idem_finish: a last argument, remember
CREATE FUNCTION idempotency.idem_finish_1_7(
	key				text,
	token			bigint,
	response_code	integer		DEFAULT NULL,
	response_body	jsonb		DEFAULT NULL,
	scope			text		DEFAULT '',
	status			text		DEFAULT 'succeeded',
	retention		interval	DEFAULT NULL,
	remember		interval	DEFAULT NULL)
RETURNS timestamptz
AS 'MODULE_PATHNAME', 'idem_finish'
LANGUAGE C VOLATILE PARALLEL UNSAFE;
SELECT idempotency.update_take_over(
	'idempotency.idem_finish(text,bigint,integer,jsonb,text,text,interval)',
	'idempotency.idem_finish_1_7(text,bigint,integer,jsonb,text,text,interval,interval)');
DROP FUNCTION idempotency.idem_finish(text, bigint, integer, jsonb, text,
									  text, interval);
ALTER FUNCTION idempotency.idem_finish_1_7(text, bigint, integer, jsonb,
										   text, text, interval, interval)
	RENAME TO idem_finish;

-- idem_finish_many: a last argument, remember
CREATE FUNCTION idempotency.idem_finish_many_1_7(
	keys			text[],
	tokens			bigint[],
	response_codes	integer[]	DEFAULT NULL,
	response_bodies	jsonb[]		DEFAULT NULL,
	scope			text		DEFAULT '',
	status			text		DEFAULT 'succeeded',
	retention		interval	DEFAULT NULL,
	remember		interval	DEFAULT NULL)
RETURNS TABLE (ord integer, key text, expires_at timestamptz)
AS 'MODULE_PATHNAME', 'idem_finish_many'
LANGUAGE C VOLATILE PARALLEL UNSAFE ROWS 100;
SELECT idempotency.update_take_over(
	'idempotency.idem_finish_many(text[],bigint[],integer[],jsonb[],text,text,interval)',
	'idempotency.idem_finish_many_1_7(text[],bigint[],integer[],jsonb[],text,text,interval,interval)');
DROP FUNCTION idempotency.idem_finish_many(text[], bigint[], integer[],
										   jsonb[], text, text, interval);
ALTER FUNCTION idempotency.idem_finish_many_1_7(text[], bigint[], integer[],
												jsonb[], text, text, interval,
												interval)
	RENAME TO idem_finish_many;

-- idem_lookup: a last column, remembered_until
CREATE FUNCTION idempotency.idem_lookup_1_7(
	key		text,
	scope	text	DEFAULT '')
RETURNS TABLE (status text, attempt integer, response_code integer,
			   response_body jsonb, created_at timestamptz,
			   finished_at timestamptz, expires_at timestamptz,
			   phase text, remembered_until timestamptz)
AS 'MODULE_PATHNAME', 'idem_lookup'
LANGUAGE C STABLE PARALLEL RESTRICTED ROWS 1;
SELECT idempotency.update_take_over(
	'idempotency.idem_lookup(text,text)',
	'idempotency.idem_lookup_1_7(text,text)');
DROP FUNCTION idempotency.idem_lookup(text, text);
ALTER FUNCTION idempotency.idem_lookup_1_7(text, text) RENAME TO idem_lookup;

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

-- stats_key_counts: a last column, remembered
CREATE FUNCTION idempotency.stats_key_counts_1_7(
	OUT pending bigint, OUT succeeded bigint, OUT failed bigint,
	OUT exact boolean, OUT remembered bigint)
RETURNS record
AS 'MODULE_PATHNAME', 'idem_stats_key_counts'
LANGUAGE C VOLATILE PARALLEL SAFE;
SELECT idempotency.update_take_over('idempotency.stats_key_counts()',
									'idempotency.stats_key_counts_1_7()');

/*
 * The stats view gains its last column, remembered, and reads the new key
 * counts; the other columns keep their names, types and order, so it is
 * replaced in place: its owner and privileges stay, and options an
 * administrator set on it (which CREATE OR REPLACE VIEW resets) are put
 * back.
 */
SELECT idempotency.update_replace_view('idempotency.stats', $view$
CREATE OR REPLACE VIEW idempotency.stats AS
SELECT d.datname AS database,
	   c.claims, c.takeovers, c.replays, c.in_progress, c.mismatches,
	   c.finishes, c.releases, c.expired, c.reset,
	   c.last_sweep_at, c.last_sweep_ms,
	   k.pending, k.succeeded, k.failed, k.exact AS key_counts_exact,
	   c.checkpoints, k.remembered
  FROM pg_catalog.pg_database d
  LEFT JOIN idempotency.stats_counters() c
	ON c.dbid OPERATOR(pg_catalog.=) d.oid
  LEFT JOIN idempotency.stats_key_counts_1_7() k
	ON d.datname OPERATOR(pg_catalog.=) pg_catalog.current_database()
 WHERE d.datname OPERATOR(pg_catalog.=) pg_catalog.current_database()
	OR c.dbid IS NOT NULL
$view$);
DROP FUNCTION idempotency.stats_key_counts();
ALTER FUNCTION idempotency.stats_key_counts_1_7() RENAME TO stats_key_counts;

/*
 * cluster_stats_rows() returns the stats view's columns after the node's
 * name, so it gains remembered too, and so does the cluster_stats view
 * over it (replaced in place as the stats view is).
 */
CREATE FUNCTION idempotency.cluster_stats_rows_1_7()
RETURNS TABLE (node text, database name, claims bigint, takeovers bigint,
			   replays bigint, in_progress bigint, mismatches bigint,
			   finishes bigint, releases bigint, expired bigint,
			   reset bigint, last_sweep_at timestamptz,
			   last_sweep_ms double precision, pending bigint,
			   succeeded bigint, failed bigint, key_counts_exact boolean,
			   checkpoints bigint, remembered bigint)
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
									'idempotency.cluster_stats_rows_1_7()');
SELECT idempotency.update_replace_view('idempotency.cluster_stats', $view$
CREATE OR REPLACE VIEW idempotency.cluster_stats AS
SELECT * FROM idempotency.cluster_stats_rows_1_7()
$view$);
DROP FUNCTION idempotency.cluster_stats_rows();
ALTER FUNCTION idempotency.cluster_stats_rows_1_7() RENAME TO cluster_stats_rows;
-- once more under the function's own name, which the view's columns are
-- qualified with, as in a fresh install
SELECT idempotency.update_replace_view('idempotency.cluster_stats', $view$
CREATE OR REPLACE VIEW idempotency.cluster_stats AS
SELECT * FROM idempotency.cluster_stats_rows()
$view$);

DROP FUNCTION idempotency.update_take_over(regprocedure, regprocedure);
DROP FUNCTION idempotency.update_replace_view(regclass, text);

/*
 * Removing a finished key on purpose, so that its next claim runs again:
 * an operator's call, so PUBLIC cannot execute it.
 */
CREATE FUNCTION idempotency.idem_forget(
	key		text,
	scope	text	DEFAULT '')
RETURNS boolean
AS 'MODULE_PATHNAME', 'idem_forget'
LANGUAGE C VOLATILE PARALLEL UNSAFE;
REVOKE ALL ON FUNCTION idempotency.idem_forget(text, text) FROM PUBLIC;


/*
 * Where Citus distributes idempotency.keys, the functions created anew
 * above and idem_forget are not delegated by scope yet: Citus passes this
 * update on to the workers only after it ran here, and a function can be
 * distributed only once every node has it.  Running distribute() again on
 * the coordinator, once every node is updated, delegates them as it did
 * the old ones (docs/scale-out.md, updating).
 */
