/* idempotency--1.4.sql: the objects of the idempotency extension, version 1.4 */

-- complain if script is sourced in psql, rather than via CREATE EXTENSION
\echo Use "CREATE EXTENSION idempotency" to load this file. \quit

/*
 * Tokens: one increasing sequence per database.  Every claim and takeover
 * draws a new value, so a token is larger than every token issued before it.
 * The sequence is non-transactional: a rolled-back claim never gives its
 * token back.  It is registered below as extension configuration, so
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
 *   expires_at   the key behaves as absent from then on
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
	CONSTRAINT keys_pkey PRIMARY KEY (scope, key)
) WITH (fillfactor = 80);
CREATE INDEX keys_sweep_at_idx ON idempotency.keys (sweep_at);
CREATE INDEX keys_owner_session_idx ON idempotency.keys (owner_session)
	WHERE owner_session IS NOT NULL;

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
	session_bound boolean	DEFAULT false)
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
	retention		interval	DEFAULT NULL)
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
	retention		interval	DEFAULT NULL)
RETURNS TABLE (ord integer, key text, expires_at timestamptz)
AS 'MODULE_PATHNAME', 'idem_finish_many'
LANGUAGE C VOLATILE PARALLEL UNSAFE ROWS 100;

CREATE FUNCTION idempotency.idem_lookup(
	key		text,
	scope	text	DEFAULT '')
RETURNS TABLE (status text, attempt integer, response_code integer,
			   response_body jsonb, created_at timestamptz,
			   finished_at timestamptz, expires_at timestamptz,
			   phase text)
AS 'MODULE_PATHNAME', 'idem_lookup'
LANGUAGE C STABLE PARALLEL RESTRICTED ROWS 1;

CREATE FUNCTION idempotency.idem_sweep(
	batch_size	integer	DEFAULT NULL)
RETURNS TABLE (expired bigint, reset bigint)
AS 'MODULE_PATHNAME', 'idem_sweep'
LANGUAGE C VOLATILE PARALLEL UNSAFE ROWS 1;

REVOKE ALL ON FUNCTION idempotency.idem_sweep(integer) FROM PUBLIC;

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
	OUT checkpoints bigint)
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
	OUT exact boolean)
RETURNS record
AS 'MODULE_PATHNAME', 'idem_stats_key_counts'
LANGUAGE C VOLATILE PARALLEL SAFE;

CREATE VIEW idempotency.stats AS
SELECT d.datname AS database,
	   c.claims, c.takeovers, c.replays, c.in_progress, c.mismatches,
	   c.finishes, c.releases, c.expired, c.reset,
	   c.last_sweep_at, c.last_sweep_ms,
	   k.pending, k.succeeded, k.failed, k.exact AS key_counts_exact,
	   c.checkpoints
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

CREATE FUNCTION idempotency.unbind_scope(role regrole)
RETURNS boolean
LANGUAGE sql VOLATILE STRICT
SET search_path = pg_catalog, pg_temp
BEGIN ATOMIC
	WITH d AS (DELETE FROM idempotency.scope_bindings b
			   WHERE b.role OPERATOR(pg_catalog.=) unbind_scope.role
			   RETURNING 1)
	SELECT pg_catalog.count(*) OPERATOR(pg_catalog.>) 0 FROM d;
END;

REVOKE ALL ON FUNCTION idempotency.bind_scope(regrole, text) FROM PUBLIC;
REVOKE ALL ON FUNCTION idempotency.unbind_scope(regrole) FROM PUBLIC;
