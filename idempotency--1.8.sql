/* idempotency--1.8.sql: the objects of the idempotency extension, version 1.8 */

-- complain if script is sourced in psql, rather than via CREATE EXTENSION
\echo Use "CREATE EXTENSION idempotency" to load this file. \quit

/*
 * Tokens: one increasing sequence per database.  Every claim and takeover
 * draws a new value, so a token is larger than every token issued before it.
 * The sequence is non-transactional: a rolled-back claim never gives its
 * token back.  (On Citus each node has its own: see distribute() below.)  It is registered below as extension configuration, so
 * pg_dump carries its position along with the keys.
 */
CREATE SEQUENCE idempotency.token_seq AS bigint NO CYCLE;

/*
 * The key store.  One row per (scope, key).  Application roles get no
 * privilege on it: they reach it only through the functions below, which
 * are the only writers (so the values below are enforced in C; a CHECK
 * constraint would be re-parsed by every write's executor start-up).
 *
 *   status       pending | succeeded | failed
 *   token        the current fencing token; NULL once the sweeper reset a
 *                stale pending key (the next claim takes over)
 *   attempt      1 for the first claim, + 1 for each takeover
 *   fingerprint  SHA-256 of the request's jsonb text; NULL: no request
 *   lease_until  a pending attempt is live until then
 *   expires_at   the key behaves as absent from then on (unless remembered)
 *   retention    the claim's retention, the default for idem_finish
 *   sweep_at     no later than the sweeper's next work on this row.  A claim
 *                sets it to the lease's end; finish and extend leave it alone
 *                (so they stay HOT updates: no indexed column changes) and the
 *                sweeper moves it forward when it finds the row early.
 *   phase        the last step an attempt recorded with idem_checkpoint; a
 *                takeover keeps it (the new attempt resumes from it), a
 *                fresh claim clears it, finish keeps it for idem_lookup
 *   phase_data   what a successor needs to resume from that step
 *   owner_session  the server session a session-bound claim is tied to
 *                (NULL: not session-bound, or no longer pending).  The
 *                session holds an advisory lock on this number while it
 *                lives; a pending key whose session holds it no more is
 *                reclaimable at once.  The partial index lets the sweeper
 *                find such keys without reading the others.
 *   remember     how long a finished key is remembered after expires_at
 *                (NULL: not).  A remembered key keeps its outcome and
 *                fingerprint and answers a claim with "expired"; the sweep
 *                drops its response and recovery point when its retention
 *                passes (moving sweep_at to expires_at + remember) and
 *                deletes it after that.
 *   request      the request a claim kept (keep_request) for a completer,
 *                until the key is finished (NULL: none kept)
 *
 * fillfactor leaves room on each page for the finish's new row version, so
 * it usually stays on the page of its claim (a HOT update).
 */
CREATE TABLE idempotency.keys (
	scope			text COLLATE "C" NOT NULL,
	key				text COLLATE "C" NOT NULL,
	status			text COLLATE "C" NOT NULL,
	token			bigint,
	attempt			integer NOT NULL,
	fingerprint		bytea,
	response_code	integer,
	response_body	jsonb,
	created_at		timestamptz NOT NULL,
	finished_at		timestamptz,
	lease_until		timestamptz,
	expires_at		timestamptz NOT NULL,
	retention		interval NOT NULL,
	sweep_at		timestamptz NOT NULL,
	phase			text COLLATE "C",
	phase_data		jsonb,
	owner_session	bigint,
	remember		interval,
	request			jsonb,
	CONSTRAINT keys_pkey PRIMARY KEY (scope, key)
) WITH (fillfactor = 80);
CREATE INDEX keys_sweep_at_idx ON idempotency.keys (sweep_at);
CREATE INDEX keys_owner_session_idx ON idempotency.keys (owner_session)
	WHERE owner_session IS NOT NULL;
/*
 * The keys a sweep reset (their attempt was abandoned), by scope and age:
 * what idem_claim_abandoned looks for, oldest first.  Neither finish nor
 * extend changes scope, created_at or token, so both stay HOT updates.
 */
CREATE INDEX keys_abandoned_idx ON idempotency.keys (scope, created_at)
	WHERE token IS NULL;

REVOKE ALL ON TABLE idempotency.keys FROM PUBLIC;
REVOKE ALL ON SEQUENCE idempotency.token_seq FROM PUBLIC;

SELECT pg_catalog.pg_extension_config_dump('idempotency.keys', '');
SELECT pg_catalog.pg_extension_config_dump('idempotency.token_seq', '');

/*
 * The client functions.  They are not SECURITY DEFINER: the C code switches
 * to the table owner only around its own fully schema-qualified statements,
 * so the caller's identity stays visible (current_user) and nothing from the
 * caller's search_path is ever looked up.
 */
/*
 * idem_claim's outcome row is a named type: callers can declare variables
 * and columns of it, and the executor takes its row type from the type
 * cache instead of rebuilding it from OUT parameters on every execution.
 */
CREATE TYPE idempotency.claim_result AS (
	outcome			text,
	token			bigint,
	attempt			integer,
	status			text,
	response_code	integer,
	response_body	jsonb,
	retry_after		integer,
	phase			text,
	phase_data		jsonb
);

CREATE FUNCTION idempotency.idem_claim(
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

CREATE FUNCTION idempotency.idem_finish(
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

CREATE FUNCTION idempotency.idem_extend(
	key		text,
	token	bigint,
	lease	interval	DEFAULT NULL,
	scope	text		DEFAULT '')
RETURNS timestamptz
AS 'MODULE_PATHNAME', 'idem_extend'
LANGUAGE C VOLATILE PARALLEL UNSAFE;

CREATE FUNCTION idempotency.idem_release(
	key		text,
	token	bigint,
	scope	text	DEFAULT '')
RETURNS void
AS 'MODULE_PATHNAME', 'idem_release'
LANGUAGE C VOLATILE PARALLEL UNSAFE;

/*
 * A recovery point: the current attempt completed the step "phase"; "data"
 * is what a successor needs to resume after it.  Made in the transaction
 * of the step's own writes, the step and its checkpoint commit together.
 */
CREATE FUNCTION idempotency.idem_checkpoint(
	key		text,
	token	bigint,
	phase	text,
	data	jsonb	DEFAULT NULL,
	scope	text	DEFAULT '')
RETURNS void
AS 'MODULE_PATHNAME', 'idem_checkpoint'
LANGUAGE C VOLATILE PARALLEL UNSAFE;

/*
 * Batches: one row per element, in array order.  idem_claim_many answers
 * each element as idem_claim would, claimed one after another in one
 * transaction; idem_finish_many finishes all of them or none.
 */
CREATE FUNCTION idempotency.idem_claim_many(
	keys			text[],
	requests		jsonb[]		DEFAULT NULL,
	scope			text		DEFAULT '',
	lease			interval	DEFAULT NULL,
	retention		interval	DEFAULT NULL,
	session_bound	boolean		DEFAULT false)
RETURNS TABLE (ord integer, key text, outcome text, token bigint,
			   attempt integer, status text, response_code integer,
			   response_body jsonb, retry_after integer, phase text,
			   phase_data jsonb)
AS 'MODULE_PATHNAME', 'idem_claim_many'
LANGUAGE C VOLATILE PARALLEL UNSAFE ROWS 100;

CREATE FUNCTION idempotency.idem_finish_many(
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

CREATE FUNCTION idempotency.idem_lookup(
	key		text,
	scope	text	DEFAULT '')
RETURNS TABLE (status text, attempt integer, response_code integer,
			   response_body jsonb, created_at timestamptz,
			   finished_at timestamptz, expires_at timestamptz,
			   phase text, remembered_until timestamptz)
AS 'MODULE_PATHNAME', 'idem_lookup'
LANGUAGE C STABLE PARALLEL RESTRICTED ROWS 1;

CREATE FUNCTION idempotency.idem_sweep(
	batch_size	integer	DEFAULT NULL)
RETURNS TABLE (expired bigint, reset bigint)
AS 'MODULE_PATHNAME', 'idem_sweep'
LANGUAGE C VOLATILE PARALLEL UNSAFE ROWS 1;

REVOKE ALL ON FUNCTION idempotency.idem_sweep(integer) FROM PUBLIC;

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
 * The version of the library the server loaded.  STABLE, not IMMUTABLE: a
 * restart can load another build, so the answer must never be folded into
 * a stored expression.
 */
CREATE FUNCTION idempotency.idem_version()
RETURNS text
AS 'MODULE_PATHNAME', 'idem_version'
LANGUAGE C STABLE PARALLEL SAFE;

/*
 * Statistics.  The counters live in shared memory (with preloading); the
 * key counts come from stats_key_counts(), which reads the table in C, so
 * roles that may use the schema see the counts without any privilege on
 * the table.
 */
CREATE FUNCTION idempotency.stats_counters(
	OUT dbid oid, OUT claims bigint, OUT takeovers bigint, OUT replays bigint,
	OUT in_progress bigint, OUT mismatches bigint, OUT finishes bigint,
	OUT releases bigint, OUT expired bigint, OUT reset bigint,
	OUT last_sweep_at timestamptz, OUT last_sweep_ms double precision,
	OUT checkpoints bigint, OUT abandoned_takeovers bigint)
RETURNS SETOF record
AS 'MODULE_PATHNAME', 'idem_stats_counters'
LANGUAGE C VOLATILE PARALLEL SAFE;

CREATE FUNCTION idempotency.stats_reset()
RETURNS void
AS 'MODULE_PATHNAME', 'idem_stats_reset'
LANGUAGE C VOLATILE PARALLEL SAFE;

REVOKE ALL ON FUNCTION idempotency.stats_reset() FROM PUBLIC;

/*
 * This database's keys by status: counted exactly while the table is small
 * (idempotency.stats_exact_limit), estimated from the planner's statistics
 * above, so that polling the view stays cheap at any size; "exact" says
 * which.  It answers only a role that may read the stats view.
 */
CREATE FUNCTION idempotency.stats_key_counts(
	OUT pending bigint, OUT succeeded bigint, OUT failed bigint,
	OUT exact boolean, OUT remembered bigint)
RETURNS record
AS 'MODULE_PATHNAME', 'idem_stats_key_counts'
LANGUAGE C VOLATILE PARALLEL SAFE;

CREATE VIEW idempotency.stats AS
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
	OR c.dbid IS NOT NULL;

GRANT SELECT ON idempotency.stats TO PUBLIC;

/*
 * Tenant isolation: a role listed here may only use scopes that start with
 * its scope_prefix, in every client function.  The role checked is the one
 * that calls the function (current_user), not a setting the session could
 * change.  Roles not listed are not restricted.  Any change to the table,
 * through the functions below or by hand, is seen by every session at its
 * next call (a trigger sends a cache invalidation).
 */
CREATE TABLE idempotency.scope_bindings (
	role			regrole PRIMARY KEY,
	scope_prefix	text COLLATE "C" NOT NULL
);
REVOKE ALL ON TABLE idempotency.scope_bindings FROM PUBLIC;
SELECT pg_catalog.pg_extension_config_dump('idempotency.scope_bindings', '');

CREATE FUNCTION idempotency.scope_bindings_changed()
RETURNS trigger
AS 'MODULE_PATHNAME', 'idem_scope_bindings_changed'
LANGUAGE C;
REVOKE ALL ON FUNCTION idempotency.scope_bindings_changed() FROM PUBLIC;

CREATE TRIGGER scope_bindings_changed
	AFTER INSERT OR UPDATE OR DELETE OR TRUNCATE
	ON idempotency.scope_bindings
	FOR EACH STATEMENT EXECUTE FUNCTION idempotency.scope_bindings_changed();

CREATE FUNCTION idempotency.bind_scope(role regrole, scope_prefix text)
RETURNS void
LANGUAGE sql VOLATILE STRICT
SET search_path = pg_catalog, pg_temp
BEGIN ATOMIC
	INSERT INTO idempotency.scope_bindings AS b (role, scope_prefix)
	VALUES (bind_scope.role, bind_scope.scope_prefix)
	ON CONFLICT (role) DO UPDATE SET scope_prefix = excluded.scope_prefix;
END;

-- a plain statement: Citus cannot plan a DELETE inside a WITH on a
-- reference table
CREATE FUNCTION idempotency.unbind_scope(role regrole)
RETURNS boolean
LANGUAGE plpgsql VOLATILE STRICT
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
	deleted bigint;
BEGIN
	DELETE FROM idempotency.scope_bindings b
	 WHERE b.role OPERATOR(pg_catalog.=) unbind_scope.role;
	GET DIAGNOSTICS deleted = ROW_COUNT;
	RETURN deleted OPERATOR(pg_catalog.>) 0;
END;
$$;

REVOKE ALL ON FUNCTION idempotency.bind_scope(regrole, text) FROM PUBLIC;
REVOKE ALL ON FUNCTION idempotency.unbind_scope(regrole) FROM PUBLIC;

/*
 * Running on Citus.  distribute() spreads idempotency.keys over the
 * cluster's nodes by scope: each scope's keys live in one shard, and every
 * client function that takes a scope is delegated by Citus to the node that
 * holds that shard (also inside a transaction block: force_delegation), so
 * that a call is one round trip to one node, where the library reads and
 * writes the shard directly.  scope_bindings becomes a reference table (a
 * copy on every node).  Calling it again does nothing more.  The tables'
 * rows stay where they are until then: a single server that grows into a
 * cluster keeps its keys (they are copied into the shards).
 */
CREATE FUNCTION idempotency.distribute(shard_count integer DEFAULT NULL)
RETURNS void
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
	fn regprocedure;
BEGIN
	-- refused before anything is read, as every function that writes is
	IF pg_catalog.current_setting('transaction_read_only')::boolean THEN
		RAISE EXCEPTION 'cannot execute distribute() in a read-only transaction'
			USING ERRCODE = '25006';
	END IF;
	IF NOT EXISTS (SELECT FROM pg_catalog.pg_extension e
				   WHERE e.extname OPERATOR(pg_catalog.=) 'citus') THEN
		RAISE EXCEPTION 'extension "citus" is not installed in this database'
			USING ERRCODE = '55000',
				  HINT = 'Put citus first in shared_preload_libraries and run CREATE EXTENSION citus.';
	END IF;
	IF NOT pg_catalog.citus_is_coordinator() THEN
		RAISE EXCEPTION 'idempotency.distribute() must run on the Citus coordinator'
			USING ERRCODE = '0A000';
	END IF;
	IF shard_count IS NOT NULL AND shard_count < 1 THEN
		RAISE EXCEPTION 'shard_count must be positive'
			USING ERRCODE = '22023';
	END IF;
	IF NOT EXISTS (SELECT FROM pg_catalog.pg_dist_partition p
				   WHERE p.logicalrelid OPERATOR(pg_catalog.=) 'idempotency.keys'::regclass) THEN
		-- its own colocation group: nothing else shares its shards' moves
		PERFORM pg_catalog.create_distributed_table('idempotency.keys', 'scope',
			colocate_with => 'none', shard_count => shard_count);
		-- the rows were copied into the shards; the shell stays empty
		PERFORM pg_catalog.truncate_local_data_after_distributing_table('idempotency.keys');
	END IF;
	IF NOT EXISTS (SELECT FROM pg_catalog.pg_dist_partition p
				   WHERE p.logicalrelid OPERATOR(pg_catalog.=) 'idempotency.scope_bindings'::regclass) THEN
		-- its trigger only tells this node's backends about a change;
		-- every node reads the bindings at each call instead
		PERFORM pg_catalog.set_config('citus.enable_unsafe_triggers', 'on', true);
		PERFORM pg_catalog.create_reference_table('idempotency.scope_bindings');
		PERFORM pg_catalog.truncate_local_data_after_distributing_table('idempotency.scope_bindings');
	END IF;
	FOR fn IN
		SELECT p.oid::regprocedure
		  FROM pg_catalog.pg_proc p
		  JOIN pg_catalog.pg_depend d
			ON d.classid OPERATOR(pg_catalog.=) 'pg_catalog.pg_proc'::regclass
		   AND d.objid OPERATOR(pg_catalog.=) p.oid
		   AND d.deptype OPERATOR(pg_catalog.=) 'e'
		  JOIN pg_catalog.pg_extension e
			ON e.oid OPERATOR(pg_catalog.=) d.refobjid
		   AND e.extname OPERATOR(pg_catalog.=) 'idempotency'
		 WHERE 'scope' OPERATOR(pg_catalog.=) ANY (p.proargnames)
		 ORDER BY p.proname, p.oid
	LOOP
		PERFORM pg_catalog.create_distributed_function(fn,
			distribution_arg_name => 'scope',
			colocate_with => 'idempotency.keys',
			force_delegation => true);
	END LOOP;
END;
$$;
REVOKE ALL ON FUNCTION idempotency.distribute(integer) FROM PUBLIC;

/*
 * The stats view of every node of the cluster, one row per node (its host
 * and port, then the columns of idempotency.stats for this database).  On
 * a server that is not a Citus coordinator: this server's row alone.
 * Sum the columns for the cluster's totals.
 */
CREATE FUNCTION idempotency.cluster_stats_rows()
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

CREATE FUNCTION idempotency.cluster_stats_failed(nodename text, nodeport integer,
												 message text)
RETURNS json
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
	RAISE EXCEPTION 'could not read idempotency.stats on node %:%: %',
		nodename, nodeport, message
		USING ERRCODE = '08000';
END;
$$;

CREATE VIEW idempotency.cluster_stats AS
SELECT * FROM idempotency.cluster_stats_rows();

GRANT SELECT ON idempotency.cluster_stats TO PUBLIC;
