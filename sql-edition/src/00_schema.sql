/*-------------------------------------------------------------------------
 *
 * 00_schema.sql
 *	  The store: the token sequence, idempotency.keys, scope_bindings, the
 *	  key lanes and the claim_result type, with their privileges.
 *
 * Owns the objects that hold data, and what pg_dump carries of them: the
 * same columns, indexes, storage and privileges as the C edition's
 * idempotency--1.6.sql and its update scripts up to 1.8, so that a dump of
 * either edition restores into the other.  Every statement creates only
 * what is missing, because running the script again is how the plain
 * installer upgrades, and it must never drop a key.  The comment that
 * follows this header opens the generated script and states the
 * conventions every later part keeps.
 *
 *-------------------------------------------------------------------------
 */

/*
 * idempotency, SQL edition: the objects of the idempotency extension in
 * PL/pgSQL and SQL only, for servers where no C extension can be loaded.
 *
 * This one text is both the script pg_tle runs for CREATE EXTENSION and
 * the body of the plain installer, so every statement is re-runnable:
 * CREATE ... IF NOT EXISTS, CREATE OR REPLACE, and DO blocks for what has
 * no such form.  Re-running it upgrades the functions in place and never
 * drops a key.  See sql-edition/README.md for how each function maps onto
 * the C edition's source and for the differences between the editions.
 *
 * Conventions: every function names every object and operator with its
 * schema, and every function a caller can reach sets search_path =
 * pg_catalog, pg_temp.  The API functions run with their owner's rights
 * (SECURITY DEFINER), which is where the C edition switches to the
 * table's owner, and check the tenant binding of the role the session
 * acts as (_caller), never of a role named in an argument.  Helpers,
 * whose names start with "_", are no API: PUBLIC may execute none of
 * them (70_privileges.sql), and the two on every call's path (_claim_key,
 * _token_call) leave the settings to the API function that runs them.
 */

/*
 * Tokens: one increasing sequence per database.  Every claim and takeover
 * draws a new value, so a token is larger than every token issued before
 * it.  The sequence is non-transactional: a rolled-back claim never gives
 * its token back.
 */
CREATE SEQUENCE IF NOT EXISTS idempotency.token_seq AS bigint NO CYCLE;

/* The key store: the same columns, indexes and storage as the C edition. */
CREATE TABLE IF NOT EXISTS idempotency.keys (
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

/*
 * How long a finished key is remembered after its retention (NULL: not
 * remembered), the last column, as versions before 1.7.0 lacked it.  Added
 * without a default, so no stored row is rewritten; asked first, because
 * ALTER TABLE locks the table even when the column exists.
 */
DO $do$
BEGIN
	IF NOT EXISTS (SELECT FROM pg_catalog.pg_attribute a
				   WHERE a.attrelid OPERATOR(pg_catalog.=) 'idempotency.keys'::pg_catalog.regclass
					 AND a.attname OPERATOR(pg_catalog.=) 'remember' AND NOT a.attisdropped) THEN
		ALTER TABLE idempotency.keys ADD COLUMN remember interval;
	END IF;
END;
$do$;

/*
 * The request a claim kept for a completer (NULL: none kept), the last
 * column, as versions before 1.8.0 lacked it: added after remember, the
 * same way, so that a table of any older version ends with the columns of
 * a fresh install in their order.
 */
DO $do$
BEGIN
	IF NOT EXISTS (SELECT FROM pg_catalog.pg_attribute a
				   WHERE a.attrelid OPERATOR(pg_catalog.=) 'idempotency.keys'::pg_catalog.regclass
					 AND a.attname OPERATOR(pg_catalog.=) 'request' AND NOT a.attisdropped) THEN
		ALTER TABLE idempotency.keys ADD COLUMN request jsonb;
	END IF;
END;
$do$;
CREATE INDEX IF NOT EXISTS keys_sweep_at_idx ON idempotency.keys (sweep_at);
CREATE INDEX IF NOT EXISTS keys_owner_session_idx ON idempotency.keys (owner_session)
	WHERE owner_session IS NOT NULL;
/*
 * The keys a sweep reset (token NULL: only a pending key whose lease or
 * session ended has none), by scope and age: idem_claim_abandoned finds a
 * scope's oldest without reading other scopes' keys.  Neither finish nor
 * extend changes scope, created_at or token, so both stay HOT updates.
 */
CREATE INDEX IF NOT EXISTS keys_abandoned_idx ON idempotency.keys (scope, created_at)
	WHERE token IS NULL;

REVOKE ALL ON TABLE idempotency.keys FROM PUBLIC;
REVOKE ALL ON SEQUENCE idempotency.token_seq FROM PUBLIC;

CREATE TABLE IF NOT EXISTS idempotency.scope_bindings (
	role			regrole PRIMARY KEY,
	scope_prefix	text COLLATE "C" NOT NULL
);
REVOKE ALL ON TABLE idempotency.scope_bindings FROM PUBLIC;

/*
 * Key lanes: a fixed set of rows whose locks stand for the keys being
 * inserted.  A claim of a new key locks its lane (the hash of scope and
 * key, one of 262144) without waiting, FOR NO KEY UPDATE SKIP LOCKED,
 * before it inserts, and keeps the lock to the end of its transaction, as
 * it keeps the row it inserts: a lane another transaction holds means a
 * key of that lane is being inserted right now, which SQL cannot see any
 * other way without waiting for that transaction.  A claim answers
 * in_progress then (one of two keys that share a lane may wait for the
 * other's transaction, the brief in_progress of a hash collision), and a
 * claim asked to wait waits on that lane's lock, waking when that
 * transaction (or savepoint) ends.  Row locks take no room in the shared
 * lock table, so a transaction may claim any number of keys, and only the
 * table's owner can lock these rows.  The rows are part of the store:
 * never delete them (a claim of a key whose lane is missing would always
 * answer in_progress).
 */
CREATE TABLE IF NOT EXISTS idempotency.key_lanes (
	lane			integer PRIMARY KEY
) WITH (fillfactor = 100);
REVOKE ALL ON TABLE idempotency.key_lanes FROM PUBLIC;
DO $do$
BEGIN
	IF (SELECT pg_catalog.count(*) FROM idempotency.key_lanes) OPERATOR(pg_catalog.<>) 262144 THEN
		INSERT INTO idempotency.key_lanes (lane)
		SELECT g FROM pg_catalog.generate_series(0, 262143) g
		ON CONFLICT (lane) DO NOTHING;
	END IF;
END;
$do$;

/*
 * pg_dump carries the keys, the sequence's position and the bindings along
 * with an extension (pg_tle); outside CREATE EXTENSION (the plain
 * installer) they are ordinary objects that pg_dump dumps anyway.  The
 * lanes are not configuration: CREATE EXTENSION makes them again.
 */
DO $do$
BEGIN
	PERFORM pg_catalog.pg_extension_config_dump('idempotency.keys', '');
	PERFORM pg_catalog.pg_extension_config_dump('idempotency.token_seq', '');
	PERFORM pg_catalog.pg_extension_config_dump('idempotency.scope_bindings', '');
EXCEPTION WHEN feature_not_supported OR object_not_in_prerequisite_state THEN
	NULL;
END;
$do$;

DO $do$
BEGIN
	IF pg_catalog.to_regtype('idempotency.claim_result') IS NULL THEN
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
	END IF;
END;
$do$;
