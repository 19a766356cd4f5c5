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
 * Conventions: every function sets search_path = pg_catalog, pg_temp and
 * names every object with its schema.  The client functions run as their
 * caller (current_user is the role the tenant bindings are checked for);
 * the table is read and written only inside the SECURITY DEFINER workers
 * (the functions whose names start with "_w_"), where the C edition
 * switches to the table's owner.  Helpers whose names start with "_" are
 * no API.
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
	CONSTRAINT keys_pkey PRIMARY KEY (scope, key)
) WITH (fillfactor = 80);
CREATE INDEX IF NOT EXISTS keys_sweep_at_idx ON idempotency.keys (sweep_at);
CREATE INDEX IF NOT EXISTS keys_owner_session_idx ON idempotency.keys (owner_session)
	WHERE owner_session IS NOT NULL;

REVOKE ALL ON TABLE idempotency.keys FROM PUBLIC;
REVOKE ALL ON SEQUENCE idempotency.token_seq FROM PUBLIC;

CREATE TABLE IF NOT EXISTS idempotency.scope_bindings (
	role			regrole PRIMARY KEY,
	scope_prefix	text COLLATE "C" NOT NULL
);
REVOKE ALL ON TABLE idempotency.scope_bindings FROM PUBLIC;

/*
 * pg_dump carries the keys, the sequence's position and the bindings along
 * with an extension (pg_tle); outside CREATE EXTENSION (the plain
 * installer) they are ordinary objects that pg_dump dumps anyway.
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

/* ---------------------------------------------------------------------
 * Helpers: settings, argument checks (args.c, guc.c)
 * ---------------------------------------------------------------------
 */

/*
 * The advisory lock class of the SQL edition: every lock it takes is
 * pg_advisory_lock(7655, n) (0x1de7, the C edition's tag for its key
 * locks).  Applications must not use this first key for their own locks.
 */
CREATE OR REPLACE FUNCTION idempotency._lock_class()
RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
RETURN 7655;

/*
 * The lock number of (scope, key), 31 bits (0 to 2^31 - 1): the scope's
 * byte length first, so that ("ab", "c") and ("a", "bc") differ.  The
 * negative numbers are the keys' insert marks (_mark_insert).  A collision
 * costs at worst an in_progress while the other key is being written: the
 * table decides every outcome.
 */
CREATE OR REPLACE FUNCTION idempotency._key_hash(scope text, key text)
RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
RETURN pg_catalog.hashtext(pg_catalog.octet_length(scope)::text
	OPERATOR(pg_catalog.||) ':' OPERATOR(pg_catalog.||) scope
	OPERATOR(pg_catalog.||) key) OPERATOR(pg_catalog.&) 2147483647;

/*
 * Before a claim inserts key "h" (holding its lock): false when another
 * transaction's insert of the key is in flight, which SQL cannot see (no
 * dirty read) and whose unique check would wait for that transaction.
 * Such an insert holds the key's mark, the advisory lock (7655, -1 - h),
 * until its transaction ends; asking for it in share mode answers without
 * waiting.  Otherwise the caller is about to insert, and marks the key
 * itself, at most 16 keys a transaction (the lock table is shared and a
 * transaction may claim any number of keys) and never in a batch that
 * would pass that number (idempotency_sql.no_marks).  An insert of an
 * unmarked key is found by the insert's own unique check, under its 1 ms
 * lock_timeout (_write_claim).  A mark taken in a subtransaction that
 * rolls back is released with it, as the row is.
 */
CREATE OR REPLACE FUNCTION idempotency._mark_insert(h integer)
RETURNS boolean
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
	m integer := -1 OPERATOR(pg_catalog.-) h;
	marks integer;
BEGIN
	IF NOT pg_catalog.pg_try_advisory_lock_shared(idempotency._lock_class(), m) THEN
		RETURN false;
	END IF;
	PERFORM pg_catalog.pg_advisory_unlock_shared(idempotency._lock_class(), m);
	IF pg_catalog.current_setting('idempotency_sql.no_marks', true) IS DISTINCT FROM 'on' THEN
		marks := COALESCE(NULLIF(pg_catalog.current_setting('idempotency_sql.marks', true), '')::integer, 0);
		IF marks OPERATOR(pg_catalog.<) 16 AND pg_catalog.pg_try_advisory_xact_lock(idempotency._lock_class(), m) THEN
			PERFORM pg_catalog.set_config('idempotency_sql.marks',
				(marks OPERATOR(pg_catalog.+) 1)::text, true);
		END IF;
	END IF;
	RETURN true;
END;
$$;

/*
 * An idempotency.* setting as an interval.  Without the C library the
 * settings are placeholders that keep the text they were given: a bare
 * number counts in the setting's unit ("unit"), as the C edition's does.
 */
CREATE OR REPLACE FUNCTION idempotency._guc_interval(name text, unit text, dflt interval)
RETURNS interval
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
	v text := pg_catalog.btrim(pg_catalog.current_setting(name, true));
	iv interval;
BEGIN
	IF v IS NULL OR v OPERATOR(pg_catalog.=) '' THEN
		RETURN dflt;
	END IF;
	IF v OPERATOR(pg_catalog.~) '^[0-9]+$' THEN
		iv := (v OPERATOR(pg_catalog.||) ' ' OPERATOR(pg_catalog.||) unit)::interval;
	ELSE
		iv := v::interval;
	END IF;
	-- a length of time, as the C edition's settings give it (24:00:00, not 1 day)
	RETURN pg_catalog.make_interval(secs => EXTRACT(epoch FROM iv));
END;
$$;

/*
 * An idempotency.* setting that counts bytes (or plain numbers).  The C
 * edition lets only superusers change max_response_size and
 * stats_exact_limit (superuser_only): a placeholder can be SET by anyone,
 * so for any other session the value it started with counts (from the
 * configuration file, ALTER DATABASE or ALTER ROLE), not what it SET.
 */
CREATE OR REPLACE FUNCTION idempotency._guc_bytes(name text, dflt bigint,
	superuser_only boolean DEFAULT false)
RETURNS bigint
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
	v text := pg_catalog.btrim(pg_catalog.current_setting(name, true));
	m text[];
BEGIN
	IF superuser_only AND NOT (SELECT r.rolsuper FROM pg_catalog.pg_roles r
							   WHERE r.rolname OPERATOR(pg_catalog.=) session_user) THEN
		SELECT pg_catalog.btrim(s.reset_val) INTO v FROM pg_catalog.pg_settings s
		 WHERE s.name OPERATOR(pg_catalog.=) _guc_bytes.name;
	END IF;
	IF v IS NULL OR v OPERATOR(pg_catalog.=) '' THEN
		RETURN dflt;
	END IF;
	m := pg_catalog.regexp_match(v, '^([0-9]+)\s*(B|kB|MB|GB|TB)?$');
	IF m IS NULL THEN
		RAISE EXCEPTION 'invalid value for parameter "%": "%"', name, v
			USING ERRCODE = '22023';
	END IF;
	RETURN m[1]::bigint OPERATOR(pg_catalog.*) CASE m[2]
		WHEN 'kB' THEN 1024 WHEN 'MB' THEN 1048576
		WHEN 'GB' THEN 1073741824 WHEN 'TB' THEN 1099511627776 ELSE 1 END;
END;
$$;

/* A key, scope or phase: not NULL, at most 255 characters, maybe not empty. */
CREATE OR REPLACE FUNCTION idempotency._check_name(t text, name text, allow_empty boolean)
RETURNS void
LANGUAGE plpgsql IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
	chars integer;
BEGIN
	IF t IS NULL THEN
		RAISE EXCEPTION '% must not be null', name USING ERRCODE = '22004';
	END IF;
	IF NOT allow_empty AND pg_catalog.octet_length(t) OPERATOR(pg_catalog.=) 0 THEN
		RAISE EXCEPTION '% must not be empty', name USING ERRCODE = '22023';
	END IF;
	IF pg_catalog.octet_length(t) OPERATOR(pg_catalog.>) 255 THEN
		chars := pg_catalog.char_length(t);
		IF chars OPERATOR(pg_catalog.>) 255 THEN
			RAISE EXCEPTION '% is too long', name
				USING ERRCODE = '22001',
					  DETAIL = pg_catalog.format('It has %s characters; the limit is %s.', chars, 255);
		END IF;
	END IF;
END;
$$;

/*
 * A lease or retention: NULL (the setting applies) or positive, and at most
 * 10000 years (interval comparison counts months as 30 days, as the C
 * edition does).
 */
CREATE OR REPLACE FUNCTION idempotency._check_positive(iv interval, name text)
RETURNS void
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
	now timestamptz;
BEGIN
	IF iv IS NULL THEN
		RETURN;
	END IF;
	IF iv OPERATOR(pg_catalog.<=) '0'::interval THEN
		RAISE EXCEPTION '% must be positive', name USING ERRCODE = '22023';
	END IF;
	IF iv OPERATOR(pg_catalog.>) '10000 years'::interval THEN
		RAISE EXCEPTION '% is too large', name
			USING ERRCODE = '22023', DETAIL = 'The limit is 10000 years.';
	END IF;
	now := pg_catalog.clock_timestamp();
	IF now OPERATOR(pg_catalog.+) iv OPERATOR(pg_catalog.<=) now THEN
		RAISE EXCEPTION '% must be positive', name USING ERRCODE = '22023';
	END IF;
END;
$$;

/* The wait argument: not NULL, not negative; capped at a hundred years. */
CREATE OR REPLACE FUNCTION idempotency._check_wait(wait interval)
RETURNS interval
LANGUAGE plpgsql IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
	IF wait IS NULL THEN
		RAISE EXCEPTION 'wait must not be null' USING ERRCODE = '22004';
	END IF;
	IF wait OPERATOR(pg_catalog.<) '0'::interval THEN
		RAISE EXCEPTION 'wait must not be negative' USING ERRCODE = '22023';
	END IF;
	RETURN LEAST(wait, '36500 days'::interval);
END;
$$;

/* The status argument of a finish: "succeeded" or "failed". */
CREATE OR REPLACE FUNCTION idempotency._check_status(status text)
RETURNS void
LANGUAGE plpgsql IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
	IF status IS NULL THEN
		RAISE EXCEPTION 'status must not be null' USING ERRCODE = '22004';
	END IF;
	IF status OPERATOR(pg_catalog.<>) ALL (ARRAY['succeeded', 'failed']) THEN
		RAISE EXCEPTION 'invalid status "%"', status
			USING ERRCODE = '22023',
				  HINT = 'A finished key has status "succeeded" or "failed".';
	END IF;
END;
$$;

/*
 * A stored jsonb within idempotency.max_response_size: its bytes before
 * compression, as a freshly built value has them (4 bytes of header).
 */
CREATE OR REPLACE FUNCTION idempotency._check_body(body jsonb, name text)
RETURNS void
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
	lim bigint;
	bytes bigint;
BEGIN
	IF body IS NULL THEN
		RETURN;
	END IF;
	lim := idempotency._guc_bytes('idempotency.max_response_size', 1048576, true);
	bytes := pg_catalog.pg_column_size(body::text::jsonb) OPERATOR(pg_catalog.-) 4;
	IF bytes OPERATOR(pg_catalog.>) lim THEN
		RAISE EXCEPTION '% is too large', name
			USING ERRCODE = '54000',
				  DETAIL = pg_catalog.format('It has %s bytes; idempotency.max_response_size is %s bytes.', bytes, lim);
	END IF;
END;
$$;

/*
 * Refuse a call that may write, before it reads anything: on a hot standby
 * and in a read-only transaction, with PostgreSQL's own messages.
 */
CREATE OR REPLACE FUNCTION idempotency._check_writable(fn text)
RETURNS void
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
	IF pg_catalog.pg_is_in_recovery() THEN
		RAISE EXCEPTION 'cannot execute % during recovery', fn USING ERRCODE = '25006';
	END IF;
	IF pg_catalog.current_setting('transaction_read_only')::boolean THEN
		RAISE EXCEPTION 'cannot execute % in a read-only transaction', fn
			USING ERRCODE = '25006';
	END IF;
END;
$$;

/* A one-dimensional array argument (or NULL). */
CREATE OR REPLACE FUNCTION idempotency._check_array(ndims integer, name text, required boolean, is_null boolean)
RETURNS void
LANGUAGE plpgsql IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
	IF is_null THEN
		IF required THEN
			RAISE EXCEPTION '% must not be null', name USING ERRCODE = '22004';
		END IF;
		RETURN;
	END IF;
	IF ndims OPERATOR(pg_catalog.>) 1 THEN
		RAISE EXCEPTION '% must be a one-dimensional array', name USING ERRCODE = '22023';
	END IF;
END;
$$;

CREATE OR REPLACE FUNCTION idempotency._check_batch_length(n integer, name text, nkeys integer)
RETURNS void
LANGUAGE plpgsql IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
	IF n IS NOT NULL AND n OPERATOR(pg_catalog.<>) nkeys THEN
		RAISE EXCEPTION '% has % elements, keys has %', name, n, nkeys
			USING ERRCODE = '22023',
				  HINT = 'Give one element per key, in the order of keys.';
	END IF;
END;
$$;

/*
 * Raise an error with these fields; an empty detail or hint is left out
 * (RAISE takes no NULL option, and an empty one would still be printed).
 */
CREATE OR REPLACE FUNCTION idempotency._raise(state text, message text,
	detail text, hint text)
RETURNS void
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
	IF detail OPERATOR(pg_catalog.<>) '' AND hint OPERATOR(pg_catalog.<>) '' THEN
		RAISE EXCEPTION USING ERRCODE = state, MESSAGE = message, DETAIL = detail, HINT = hint;
	ELSIF detail OPERATOR(pg_catalog.<>) '' THEN
		RAISE EXCEPTION USING ERRCODE = state, MESSAGE = message, DETAIL = detail;
	ELSIF hint OPERATOR(pg_catalog.<>) '' THEN
		RAISE EXCEPTION USING ERRCODE = state, MESSAGE = message, HINT = hint;
	ELSE
		RAISE EXCEPTION USING ERRCODE = state, MESSAGE = message;
	END IF;
END;
$$;

/* Name a key in messages: "key" or "key" in scope "scope". */
CREATE OR REPLACE FUNCTION idempotency._key_display(scope text, key text)
RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
RETURN CASE WHEN scope OPERATOR(pg_catalog.=) '' THEN pg_catalog.format('"%s"', key)
	ELSE pg_catalog.format('"%s" in scope "%s"', key, scope) END;

/* SHA-256 of the request's jsonb text, in the database's bytes (fingerprint.c). */
CREATE OR REPLACE FUNCTION idempotency._fingerprint(request jsonb)
RETURNS bytea
LANGUAGE sql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
RETURN pg_catalog.sha256(pg_catalog.convert_to(request::text, pg_catalog.getdatabaseencoding()));

/* ---------------------------------------------------------------------
 * The extension's objects, checked (catalog.c)
 * ---------------------------------------------------------------------
 */

/*
 * Refuse a store that is not as this script made it: a missing table,
 * sequence or index, a table that is no member of the extension (under
 * pg_tle; the plain installer makes no extension), columns of other names
 * or types, a lost NOT NULL, or an index on other columns.  The SQL
 * edition has no relation cache to keep this in, so it reads the catalog
 * at every call (a few index lookups).
 */
CREATE OR REPLACE FUNCTION idempotency._check_catalog()
RETURNS void
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
	names text[] := ARRAY['scope', 'key', 'status', 'token', 'attempt',
		'fingerprint', 'response_code', 'response_body', 'created_at',
		'finished_at', 'lease_until', 'expires_at', 'retention', 'sweep_at',
		'phase', 'phase_data', 'owner_session'];
	types oid[] := ARRAY['text'::regtype, 'text'::regtype, 'text'::regtype,
		'bigint'::regtype, 'integer'::regtype, 'bytea'::regtype,
		'integer'::regtype, 'jsonb'::regtype, 'timestamptz'::regtype,
		'timestamptz'::regtype, 'timestamptz'::regtype, 'timestamptz'::regtype,
		'interval'::regtype, 'timestamptz'::regtype, 'text'::regtype,
		'jsonb'::regtype, 'bigint'::regtype]::oid[];
	required boolean[] := ARRAY[true, true, true, false, true, false, false,
		false, true, false, false, true, true, true, false, false, false];
	nsp oid := pg_catalog.to_regnamespace('idempotency');
	ext oid;
	keys oid;
	seq oid;
	idx oid;
	natts integer;
	a record;
	ok boolean;
BEGIN
	IF nsp IS NOT NULL THEN
		keys := pg_catalog.to_regclass('idempotency.keys');
		seq := pg_catalog.to_regclass('idempotency.token_seq');
	END IF;
	IF keys IS NULL OR seq IS NULL THEN
		RAISE EXCEPTION 'extension "idempotency" is not installed in this database'
			USING ERRCODE = '42704', HINT = 'Run CREATE EXTENSION idempotency.';
	END IF;
	SELECT e.oid INTO ext FROM pg_catalog.pg_extension e
	 WHERE e.extname OPERATOR(pg_catalog.=) 'idempotency';
	IF ext IS NOT NULL THEN
		FOREACH idx IN ARRAY ARRAY[keys, seq] LOOP
			IF NOT EXISTS (SELECT FROM pg_catalog.pg_depend d
						   WHERE d.classid OPERATOR(pg_catalog.=) 'pg_catalog.pg_class'::regclass
							 AND d.objid OPERATOR(pg_catalog.=) idx
							 AND d.refclassid OPERATOR(pg_catalog.=) 'pg_catalog.pg_extension'::regclass
							 AND d.refobjid OPERATOR(pg_catalog.=) ext
							 AND d.deptype OPERATOR(pg_catalog.=) 'e') THEN
				RAISE EXCEPTION 'relation "%" is not a member of extension "idempotency"',
					(SELECT c.relname FROM pg_catalog.pg_class c WHERE c.oid OPERATOR(pg_catalog.=) idx)
					USING ERRCODE = '55000',
						  HINT = 'Someone replaced the extension''s objects; reinstall the extension.';
			END IF;
		END LOOP;
	END IF;
	IF pg_catalog.to_regclass('idempotency.keys_pkey') IS NULL THEN
		RAISE EXCEPTION 'index "keys_pkey" of extension "idempotency" is missing'
			USING ERRCODE = '55000', HINT = 'Someone dropped the extension''s objects; reinstall the extension.';
	END IF;
	IF pg_catalog.to_regclass('idempotency.keys_sweep_at_idx') IS NULL THEN
		RAISE EXCEPTION 'index "keys_sweep_at_idx" of extension "idempotency" is missing'
			USING ERRCODE = '55000', HINT = 'Someone dropped the extension''s objects; reinstall the extension.';
	END IF;
	SELECT c.relnatts INTO natts FROM pg_catalog.pg_class c WHERE c.oid OPERATOR(pg_catalog.=) keys;
	IF natts OPERATOR(pg_catalog.<>) 17 THEN
		RAISE EXCEPTION 'table "idempotency.keys" is not as extension "idempotency" created it'
			USING ERRCODE = '55000', HINT = 'Someone replaced the extension''s objects; reinstall the extension.';
	END IF;
	FOR a IN
		SELECT t.attnum, t.attname, t.atttypid, t.attisdropped, t.attnotnull
		  FROM pg_catalog.pg_attribute t
		 WHERE t.attrelid OPERATOR(pg_catalog.=) keys AND t.attnum OPERATOR(pg_catalog.>) 0
		 ORDER BY t.attnum
	LOOP
		IF a.attisdropped OR a.atttypid OPERATOR(pg_catalog.<>) types[a.attnum]
		   OR a.attname::text OPERATOR(pg_catalog.<>) names[a.attnum] THEN
			RAISE EXCEPTION 'table "idempotency.keys" is not as extension "idempotency" created it'
				USING ERRCODE = '55000', HINT = 'Someone replaced the extension''s objects; reinstall the extension.';
		END IF;
		IF required[a.attnum] AND NOT a.attnotnull THEN
			RAISE EXCEPTION 'column "%" of table "idempotency.keys" has lost its NOT NULL constraint', a.attname
				USING ERRCODE = '55000',
					  DETAIL = 'Extension "idempotency" creates it NOT NULL and relies on a value in every row.',
					  HINT = pg_catalog.format('Restore the constraint with ALTER TABLE idempotency.keys ALTER COLUMN %s SET NOT NULL.',
						  pg_catalog.quote_ident(a.attname));
		END IF;
	END LOOP;
	FOR a IN
		SELECT n.name, n.cols, n.partial FROM (VALUES
			('keys_pkey', '1 2', false), ('keys_sweep_at_idx', '14', false),
			('keys_owner_session_idx', '17', true)) n(name, cols, partial)
	LOOP
		idx := pg_catalog.to_regclass('idempotency.' OPERATOR(pg_catalog.||) a.name);
		IF idx IS NULL THEN
			RAISE EXCEPTION 'index "%" of extension "idempotency" is missing', a.name
				USING ERRCODE = '55000', HINT = 'Someone dropped the extension''s objects; reinstall the extension.';
		END IF;
		SELECT i.indrelid OPERATOR(pg_catalog.=) keys AND i.indisvalid
			   AND c.relam OPERATOR(pg_catalog.=) (SELECT m.oid FROM pg_catalog.pg_am m WHERE m.amname OPERATOR(pg_catalog.=) 'btree')
			   AND i.indnkeyatts::text OPERATOR(pg_catalog.=) pg_catalog.array_length(pg_catalog.string_to_array(a.cols, ' '), 1)::text
			   AND pg_catalog.array_to_string(i.indkey[0:i.indnkeyatts OPERATOR(pg_catalog.-) 1], ' ') OPERATOR(pg_catalog.=) a.cols
			   AND i.indexprs IS NULL AND (i.indpred IS NOT NULL) OPERATOR(pg_catalog.=) a.partial
		  INTO ok
		  FROM pg_catalog.pg_index i JOIN pg_catalog.pg_class c ON c.oid OPERATOR(pg_catalog.=) i.indexrelid
		 WHERE i.indexrelid OPERATOR(pg_catalog.=) idx;
		IF NOT COALESCE(ok, false) THEN
			RAISE EXCEPTION 'index "%" is not the index extension "idempotency" created', a.name
				USING ERRCODE = '55000', HINT = 'Someone replaced the extension''s objects; reinstall the extension.';
		END IF;
	END LOOP;
END;
$$;

/* The bindings table: present, a member, and of its two columns. */
CREATE OR REPLACE FUNCTION idempotency._check_bindings()
RETURNS void
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
	rel oid := pg_catalog.to_regclass('idempotency.scope_bindings');
	ext oid;
BEGIN
	IF rel IS NULL THEN
		RAISE EXCEPTION 'table "idempotency.scope_bindings" of extension "idempotency" is missing'
			USING ERRCODE = '55000', HINT = 'Someone dropped the extension''s objects; reinstall the extension.';
	END IF;
	SELECT e.oid INTO ext FROM pg_catalog.pg_extension e
	 WHERE e.extname OPERATOR(pg_catalog.=) 'idempotency';
	IF ext IS NOT NULL AND NOT EXISTS (
		SELECT FROM pg_catalog.pg_depend d
		 WHERE d.classid OPERATOR(pg_catalog.=) 'pg_catalog.pg_class'::regclass
		   AND d.objid OPERATOR(pg_catalog.=) rel
		   AND d.refclassid OPERATOR(pg_catalog.=) 'pg_catalog.pg_extension'::regclass
		   AND d.refobjid OPERATOR(pg_catalog.=) ext AND d.deptype OPERATOR(pg_catalog.=) 'e') THEN
		RAISE EXCEPTION 'relation "scope_bindings" is not a member of extension "idempotency"'
			USING ERRCODE = '55000', HINT = 'Someone replaced the extension''s objects; reinstall the extension.';
	END IF;
	IF (SELECT c.relnatts FROM pg_catalog.pg_class c WHERE c.oid OPERATOR(pg_catalog.=) rel) OPERATOR(pg_catalog.<>) 2
	   OR (SELECT pg_catalog.array_agg(t.atttypid ORDER BY t.attnum) FROM pg_catalog.pg_attribute t
		   WHERE t.attrelid OPERATOR(pg_catalog.=) rel AND t.attnum OPERATOR(pg_catalog.>) 0 AND NOT t.attisdropped)
		  OPERATOR(pg_catalog.<>) ARRAY['regrole'::regtype, 'text'::regtype]::oid[] THEN
		RAISE EXCEPTION 'table "idempotency.scope_bindings" is not as extension "idempotency" created it'
			USING ERRCODE = '55000', HINT = 'Someone replaced the extension''s objects; reinstall the extension.';
	END IF;
END;
$$;

/* ---------------------------------------------------------------------
 * Tenant bindings (tenant.c)
 * ---------------------------------------------------------------------
 */

/*
 * Raise 42501 unless "caller" may use "scope".  A worker cannot see who
 * called it, so the client functions pass current_user; a name that the
 * session's own role could not have become by SET ROLE is not trusted on
 * its own, and the session user's binding is checked as well.  So calling
 * a worker directly never gets a role further than SET ROLE would.
 */
CREATE OR REPLACE FUNCTION idempotency._tenant_check(caller name, scope text)
RETURNS void
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
	roles name[] := ARRAY[caller];
	r name;
	prefix text;
BEGIN
	PERFORM idempotency._check_bindings();
	IF NOT EXISTS (SELECT FROM idempotency.scope_bindings) THEN
		RETURN;
	END IF;
	IF EXISTS (SELECT FROM idempotency.scope_bindings b
			   WHERE b.role IS NULL OR b.scope_prefix IS NULL) THEN
		RAISE EXCEPTION 'table "idempotency.scope_bindings" has a row with a NULL role or prefix'
			USING ERRCODE = 'XX001', HINT = 'Someone changed the table''s constraints; delete that row.';
	END IF;
	IF caller OPERATOR(pg_catalog.<>) session_user
	   AND NOT pg_catalog.pg_has_role(session_user, caller, 'MEMBER') THEN
		roles := roles OPERATOR(pg_catalog.||) session_user;
	END IF;
	FOREACH r IN ARRAY roles LOOP
		SELECT b.scope_prefix INTO prefix
		  FROM idempotency.scope_bindings b
		 WHERE b.role::oid OPERATOR(pg_catalog.=)
			   (SELECT a.oid FROM pg_catalog.pg_roles a WHERE a.rolname OPERATOR(pg_catalog.=) r);
		IF FOUND AND NOT pg_catalog.starts_with(scope, prefix) THEN
			RAISE EXCEPTION 'permission denied for idempotency scope "%"', scope
				USING ERRCODE = '42501',
					  DETAIL = pg_catalog.format('Role "%s" may only use scopes that start with "%s".', r, prefix);
		END IF;
	END LOOP;
END;
$$;

/* ---------------------------------------------------------------------
 * Reading a key (row.c)
 * ---------------------------------------------------------------------
 */

/* The xid8 of a 32-bit xid seen by the snapshot "snap"; NULL for none. */
CREATE OR REPLACE FUNCTION idempotency._xid8(x xid, snap pg_snapshot)
RETURNS xid8
LANGUAGE plpgsql IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
	x32 bigint := x::text::bigint;
	nxt bigint := pg_catalog.pg_snapshot_xmax(snap)::text::bigint;
	d bigint;
BEGIN
	IF x32 OPERATOR(pg_catalog.<) 3 THEN
		RETURN NULL;			-- invalid, bootstrap or frozen
	END IF;
	-- the distance from the snapshot's horizon, modulo 2^32, as a signed
	-- number: our own xids may lie just beyond it
	d := ((x32 OPERATOR(pg_catalog.-) (nxt OPERATOR(pg_catalog.&) 4294967295)
		   OPERATOR(pg_catalog.+) 2147483648) OPERATOR(pg_catalog.&) 4294967295)
		 OPERATOR(pg_catalog.-) 2147483648;
	IF nxt OPERATOR(pg_catalog.+) d OPERATOR(pg_catalog.<) 3 THEN
		RETURN NULL;
	END IF;
	RETURN (nxt OPERATOR(pg_catalog.+) d)::text::xid8;
END;
$$;

/*
 * Refuse (XX001) a stored row that the functions never write: a NULL in a
 * NOT NULL column, an unknown status, a fingerprint that is no SHA-256.
 */
CREATE OR REPLACE FUNCTION idempotency._check_row(p_scope text, p_key text,
	status text, attempt integer, created_at timestamptz, expires_at timestamptz,
	retention interval, sweep_at timestamptz, fingerprint bytea)
RETURNS void
LANGUAGE plpgsql IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
	IF status IS NULL OR attempt IS NULL OR created_at IS NULL OR
	   expires_at IS NULL OR retention IS NULL OR sweep_at IS NULL THEN
		RAISE EXCEPTION 'idempotency key % has no value in column "%"',
			idempotency._key_display(p_scope, p_key),
			CASE WHEN status IS NULL THEN 'status' WHEN attempt IS NULL THEN 'attempt'
				 WHEN created_at IS NULL THEN 'created_at' WHEN expires_at IS NULL THEN 'expires_at'
				 WHEN retention IS NULL THEN 'retention' ELSE 'sweep_at' END
			USING ERRCODE = 'XX001',
				  HINT = 'Someone changed idempotency.keys outside the extension''s functions.';
	END IF;
	IF status OPERATOR(pg_catalog.<>) ALL (ARRAY['pending', 'succeeded', 'failed']) THEN
		RAISE EXCEPTION 'idempotency key has an unknown status "%"', status
			USING ERRCODE = 'XX001',
				  HINT = 'Someone changed idempotency.keys outside the extension''s functions.';
	END IF;
	IF fingerprint IS NOT NULL AND pg_catalog.octet_length(fingerprint) OPERATOR(pg_catalog.<>) 32 THEN
		RAISE EXCEPTION 'idempotency key has a fingerprint of % bytes, expected 32',
			pg_catalog.octet_length(fingerprint)
			USING ERRCODE = 'XX001',
				  HINT = 'Someone changed idempotency.keys outside the extension''s functions.';
	END IF;
END;
$$;

/*
 * Is the row version whose xmax is "x" changed or row-locked right now by
 * another transaction through a multixact?  A row that several
 * transactions lock, or that one transaction locks and then updates in a
 * subtransaction (every worker writes inside an exception block), carries
 * a multixact id in xmax, which SQL cannot tell from a transaction id: so
 * "x" is read as a multixact too.  It counts as busy when one of its
 * members is still running and is not ours, while another backend holds a
 * lock on idempotency.keys (every transaction that locks or changes a row
 * of the table does until it ends: that keeps a transaction id that is
 * also the number of some other table's multixact from counting, unless
 * the table is in use right then).  A member is taken for ours when it is
 * our transaction's id or newer than it (our subtransactions' ids are; a
 * transaction that began after ours and locks the row is then missed, and
 * the write that follows waits for it).  An "x" that is no multixact (too
 * old, or not created yet) is not busy.
 */
CREATE OR REPLACE FUNCTION idempotency._multi_busy(x xid, snap pg_snapshot)
RETURNS boolean
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
	m record;
	x8 xid8;
	top xid8 := pg_catalog.pg_current_xact_id_if_assigned();
BEGIN
	FOR m IN SELECT mm.xid FROM pg_catalog.pg_get_multixact_members(x) mm LOOP
		x8 := idempotency._xid8(m.xid, snap);
		CONTINUE WHEN x8 IS NULL OR
			pg_catalog.pg_xact_status(x8) IS DISTINCT FROM 'in progress' OR
			x8 OPERATOR(pg_catalog.>=) top;
		RETURN EXISTS (SELECT FROM pg_catalog.pg_locks r
						WHERE r.locktype OPERATOR(pg_catalog.=) 'relation'
						  AND r.relation OPERATOR(pg_catalog.=) 'idempotency.keys'::pg_catalog.regclass
						  AND r.granted
						  AND r.pid OPERATOR(pg_catalog.<>) pg_catalog.pg_backend_pid());
	END LOOP;
	RETURN false;
EXCEPTION WHEN OTHERS THEN
	RETURN false;				-- no such multixact: a plain transaction id
END;
$$;

/*
 * Read one key at its newest committed state, as a claim must judge it,
 * without waiting and without locking anything.  The SQL edition has no
 * dirty snapshot, so it reads the row version its statement sees and asks
 * the version's xmin and xmax:
 *   - xmin still running: our own transaction wrote it ("mine": another
 *     transaction's uncommitted version is never visible);
 *   - xmax running and not ours: another transaction is changing, deleting
 *     or row-locking it right now ("busy");
 *   - xmax committed after the statement's snapshot: a newer version was
 *     committed meanwhile; read again (READ COMMITTED), or, where the
 *     transaction's snapshot may not move (REPEATABLE READ, SERIALIZABLE),
 *     raise a serialization failure.
 * That last test is not complete: a snapshot lists running top-level
 * transactions only, so a change made in a subtransaction (every writer
 * writes inside an exception block) or through a multixact, committed
 * between the statement's snapshot and the questions, looks as if it
 * committed before.  The version read is then the one the snapshot saw,
 * which answers consistently as of that moment, but the version to write
 * has been replaced: every write by tid that finds no row reads the key
 * again.
 * A key another transaction is inserting is invisible here; its claim's
 * insert finds it (the unique check) and answers in_progress.
 */
CREATE OR REPLACE FUNCTION idempotency._probe(p_scope text, p_key text,
	OUT present boolean, OUT busy boolean, OUT mine boolean, OUT tid tid,
	OUT status text, OUT token bigint, OUT attempt integer, OUT fingerprint bytea,
	OUT response_code integer, OUT response_body jsonb,
	OUT created_at timestamptz, OUT finished_at timestamptz,
	OUT lease_until timestamptz, OUT expires_at timestamptz,
	OUT retention interval, OUT sweep_at timestamptz, OUT phase text,
	OUT phase_data jsonb, OUT owner_session bigint)
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
	rec record;
	x8 xid8;
	st text;
BEGIN
	busy := false;
	mine := false;
	FOR round IN 1..10 LOOP
		SELECT k.*, k.ctid AS tid_, k.xmin AS xmin_, k.xmax AS xmax_,
			   pg_catalog.pg_current_snapshot() AS snap_
		  INTO rec
		  FROM idempotency.keys k
		 WHERE k.scope OPERATOR(pg_catalog.=) p_scope
		   AND k.key OPERATOR(pg_catalog.=) p_key;
		present := FOUND;
		IF NOT present THEN
			RETURN;
		END IF;
		tid := rec.tid_; status := rec.status; token := rec.token;
		attempt := rec.attempt; fingerprint := rec.fingerprint;
		response_code := rec.response_code; response_body := rec.response_body;
		created_at := rec.created_at; finished_at := rec.finished_at;
		lease_until := rec.lease_until; expires_at := rec.expires_at;
		retention := rec.retention; sweep_at := rec.sweep_at;
		phase := rec.phase; phase_data := rec.phase_data;
		owner_session := rec.owner_session;
		PERFORM idempotency._check_row(p_scope, p_key, status, attempt, created_at,
			expires_at, retention, sweep_at, fingerprint);
		x8 := idempotency._xid8(rec.xmin_, rec.snap_);
		mine := x8 IS NOT NULL AND
			pg_catalog.pg_xact_status(x8) OPERATOR(pg_catalog.=) 'in progress';
		IF rec.xmax_ OPERATOR(pg_catalog.=) '0'::xid THEN
			RETURN;				-- never changed, deleted or locked
		END IF;
		x8 := idempotency._xid8(rec.xmax_, rec.snap_);
		IF x8 IS NULL THEN
			busy := idempotency._multi_busy(rec.xmax_, rec.snap_);
			RETURN;
		END IF;
		st := pg_catalog.pg_xact_status(x8);
		IF st OPERATOR(pg_catalog.=) 'in progress' THEN
			-- running: another transaction's change or row lock, unless it is
			-- ours (a transaction holds the lock on each of its xids)
			busy := x8 IS DISTINCT FROM pg_catalog.pg_current_xact_id_if_assigned() AND
				NOT EXISTS (SELECT FROM pg_catalog.pg_locks l
							 WHERE l.locktype OPERATOR(pg_catalog.=) 'transactionid'
							   AND l.transactionid OPERATOR(pg_catalog.=) rec.xmax_
							   AND l.pid OPERATOR(pg_catalog.=) pg_catalog.pg_backend_pid());
			RETURN;
		END IF;
		IF idempotency._multi_busy(rec.xmax_, rec.snap_) THEN
			busy := true;
			RETURN;
		END IF;
		IF st IS DISTINCT FROM 'committed' OR
		   pg_catalog.pg_visible_in_snapshot(x8, rec.snap_) THEN
			RETURN;				-- aborted, or a row lock that has ended
		END IF;
		IF pg_catalog.current_setting('transaction_isolation') OPERATOR(pg_catalog.<>) 'read committed' THEN
			RAISE EXCEPTION 'could not serialize access due to concurrent update of an idempotency key'
				USING ERRCODE = '40001', HINT = 'Retry the transaction.';
		END IF;
	END LOOP;
	busy := true;
END;
$$;

/* ---------------------------------------------------------------------
 * Session-bound claims (session.c)
 * ---------------------------------------------------------------------
 */

/*
 * This session's binding: its pid and the millisecond its backend started,
 * as one number (pid << 41 | start mod 2^41).  No two sessions alive at
 * once share it, and a session that ended is recognised by it: no backend
 * with that pid started at that moment any more.
 */
CREATE OR REPLACE FUNCTION idempotency._session_binding()
RETURNS bigint
LANGUAGE sql STABLE
SET search_path = pg_catalog, pg_temp
RETURN (SELECT (a.pid::bigint OPERATOR(pg_catalog.<<) 41) OPERATOR(pg_catalog.|)
			   (pg_catalog.floor(EXTRACT(epoch FROM a.backend_start) OPERATOR(pg_catalog.*) 1000)::bigint
				OPERATOR(pg_catalog.&) 2199023255551)
		  FROM pg_catalog.pg_stat_get_activity(pg_catalog.pg_backend_pid()) a);

/*
 * Is the session with binding "b" alive?  Asked of the server's activity
 * list, read afresh (it is otherwise cached for the transaction).  When
 * the list does not show that backend's start (no privilege), the session
 * counts as alive: its lease still ends.
 */
CREATE OR REPLACE FUNCTION idempotency._session_alive(b bigint)
RETURNS boolean
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
	pid integer := (b OPERATOR(pg_catalog.>>) 41)::integer;
	start_ms bigint := b OPERATOR(pg_catalog.&) 2199023255551;
	started timestamptz;
BEGIN
	IF pid OPERATOR(pg_catalog.=) pg_catalog.pg_backend_pid() THEN
		RETURN b OPERATOR(pg_catalog.=) idempotency._session_binding();
	END IF;
	IF pid OPERATOR(pg_catalog.<=) 0 THEN
		RETURN false;
	END IF;
	PERFORM pg_catalog.pg_stat_clear_snapshot();
	SELECT a.backend_start INTO started
	  FROM pg_catalog.pg_stat_get_activity(pid) a;
	IF NOT FOUND THEN
		RETURN false;
	END IF;
	IF started IS NULL THEN
		RETURN true;
	END IF;
	RETURN (pg_catalog.floor(EXTRACT(epoch FROM started) OPERATOR(pg_catalog.*) 1000)::bigint
			OPERATOR(pg_catalog.&) 2199023255551) OPERATOR(pg_catalog.=) start_ms;
END;
$$;

/* ---------------------------------------------------------------------
 * Claims (claim.c, write.c)
 * ---------------------------------------------------------------------
 */

/*
 * Write a claim: insert a new key, or turn the probed row version "old_tid"
 * into a new pending attempt.  A key that another transaction is
 * inserting is invisible here (SQL has no dirty read); the insert's unique
 * check meets it and would wait for that transaction.  Its own lock_timeout
 * makes the check give up after 1 ms instead (the caller answers
 * in_progress): the SQL edition's one wait on another transaction, the
 * shortest PostgreSQL offers.  The timeout covers every lock the write
 * waits for; the caller tells a wait for a row of the key from the others
 * by the error's context.  Marking new keys with advisory locks held to
 * commit would avoid it, but would hold a lock per key until commit.
 */
CREATE OR REPLACE FUNCTION idempotency._write_claim(p_scope text, p_key text,
	old_tid tid, p_token bigint, p_attempt integer, p_fp bytea,
	p_created timestamptz, p_now timestamptz, p_lease_until timestamptz,
	p_expires timestamptz, p_retention interval, p_sweep_at timestamptz,
	p_keep_phase boolean, p_owner bigint)
RETURNS boolean
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
SET lock_timeout = '1ms'
AS $$
BEGIN
	IF old_tid IS NULL THEN
		INSERT INTO idempotency.keys (scope, key, status, token, attempt,
			fingerprint, response_code, response_body, created_at, finished_at,
			lease_until, expires_at, retention, sweep_at, phase, phase_data,
			owner_session)
		VALUES (p_scope, p_key, 'pending', p_token, 1, p_fp, NULL, NULL,
			p_now, NULL, p_lease_until, p_expires, p_retention, p_lease_until,
			NULL, NULL, p_owner);
		RETURN true;
	END IF;
	IF p_keep_phase THEN
		UPDATE idempotency.keys k
		   SET status = 'pending', token = p_token, attempt = p_attempt,
			   fingerprint = p_fp, response_code = NULL, response_body = NULL,
			   created_at = p_created, finished_at = NULL,
			   lease_until = p_lease_until, expires_at = p_expires,
			   retention = p_retention, sweep_at = p_sweep_at,
			   owner_session = p_owner
		 WHERE k.ctid OPERATOR(pg_catalog.=) old_tid;
	ELSE
		UPDATE idempotency.keys k
		   SET status = 'pending', token = p_token, attempt = p_attempt,
			   fingerprint = p_fp, response_code = NULL, response_body = NULL,
			   created_at = p_created, finished_at = NULL,
			   lease_until = p_lease_until, expires_at = p_expires,
			   retention = p_retention, sweep_at = p_sweep_at,
			   phase = NULL, phase_data = NULL, owner_session = p_owner
		 WHERE k.ctid OPERATOR(pg_catalog.=) old_tid;
	END IF;
	RETURN FOUND;
END;
$$;

/*
 * The first token a claim of this transaction handed out, so that a later
 * claim of the same transaction knows a claim it holds itself (a
 * transaction-local setting: a rollback, also to a savepoint, forgets it).
 */
CREATE OR REPLACE FUNCTION idempotency._held_here(mine boolean, token bigint)
RETURNS boolean
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
	first text := pg_catalog.current_setting('idempotency_sql.xact_first_token', true);
BEGIN
	RETURN mine AND token IS NOT NULL AND first IS NOT NULL AND first OPERATOR(pg_catalog.<>) ''
		AND token OPERATOR(pg_catalog.>=) first::bigint;
END;
$$;

/*
 * Make the token sequence's position durable before a token leaves the
 * server: a value handed out under a sequence record that is not flushed
 * yet could be handed out again after a crash.  SQL cannot read the
 * sequence page's LSN as the C edition does, so when any WAL is
 * unflushed it writes a tiny non-transactional WAL message and flushes up
 * to it (PostgreSQL 17's pg_logical_emit_message(..., flush)); before 17
 * the commit's flush is all there is (documented).
 */
CREATE OR REPLACE FUNCTION idempotency._flush_tokens()
RETURNS void
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
	IF pg_catalog.current_setting('server_version_num')::integer OPERATOR(pg_catalog.>=) 170000
	   AND pg_catalog.pg_current_wal_flush_lsn() OPERATOR(pg_catalog.<) pg_catalog.pg_current_wal_insert_lsn() THEN
		PERFORM pg_catalog.pg_logical_emit_message(false, 'idempotency', '', true);
	END IF;
END;
$$;

/*
 * One claim attempt (claim.c, claim_once): answer from a lock-free probe
 * when possible; else take the key's advisory lock without waiting, probe
 * again, write, and let the lock go at once.  The lock is session-level
 * (a transaction-level one could not be released before commit, and a
 * batch of 10,000 claims would fill the lock table), so an error in
 * between releases it explicitly.  Besides the claim's columns it says
 * whether another transaction is changing the key (busy), whether our own
 * transaction holds the claim (held), and until when the lease it met runs.
 */
CREATE OR REPLACE FUNCTION idempotency._w_claim(caller name, fn text,
	p_key text, p_request jsonb, p_scope text, p_lease interval,
	p_retention interval, p_session_bound boolean, p_flush boolean,
	OUT outcome text, OUT token bigint, OUT attempt integer, OUT status text,
	OUT response_code integer, OUT response_body jsonb, OUT retry_after integer,
	OUT phase text, OUT phase_data jsonb,
	OUT busy boolean, OUT held boolean, OUT lease_until timestamptz)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
	now timestamptz;
	p record;
	h integer;
	action text;
	lease interval;
	retention interval;
	expires timestamptz;
	owner bigint;
	new_attempt integer;
	p_fp bytea;
	round integer := 0;
	stalls integer := 0;
	ctx text;
BEGIN
	PERFORM idempotency._check_name(p_key, 'key', false);
	PERFORM idempotency._check_name(p_scope, 'scope', true);
	PERFORM idempotency._check_positive(p_lease, 'lease');
	PERFORM idempotency._check_positive(p_retention, 'retention');
	IF p_session_bound IS NULL THEN
		RAISE EXCEPTION 'session_bound must not be null' USING ERRCODE = '22004';
	END IF;
	PERFORM idempotency._check_writable(fn);
	PERFORM idempotency._tenant_check(caller, p_scope);
	PERFORM idempotency._check_catalog();
	IF p_request IS NOT NULL THEN
		p_fp := idempotency._fingerprint(p_request);
	END IF;
	busy := false;
	held := false;
	h := idempotency._key_hash(p_scope, p_key);

	LOOP
		round := round OPERATOR(pg_catalog.+) 1;
		EXIT WHEN round OPERATOR(pg_catalog.>) 2;
		now := pg_catalog.clock_timestamp();
		SELECT * INTO p FROM idempotency._probe(p_scope, p_key);
		-- claim_decide
		outcome := NULL; token := NULL; attempt := NULL; status := NULL;
		response_code := NULL; response_body := NULL; retry_after := NULL;
		phase := NULL; phase_data := NULL; lease_until := NULL;
		IF p.busy OR (NOT p.present AND
			pg_catalog.current_setting('idempotency_sql.probe_only', true) OPERATOR(pg_catalog.=) 'on') THEN
			-- busy, or absent while a waiting idem_claim knows that another
			-- transaction is inserting the key (see there)
			outcome := 'in_progress'; retry_after := 1; busy := true;
			RETURN;
		ELSIF NOT p.present OR p.expires_at OPERATOR(pg_catalog.<=) now THEN
			action := 'fresh';
		ELSIF p.fingerprint IS DISTINCT FROM p_fp THEN
			outcome := 'mismatch';
			RETURN;
		ELSIF p.status OPERATOR(pg_catalog.<>) 'pending' THEN
			outcome := 'replay'; status := p.status;
			response_code := p.response_code; response_body := p.response_body;
			RETURN;
		ELSIF p.token IS NOT NULL AND
			  (idempotency._held_here(p.mine, p.token) OR
			   (p.lease_until OPERATOR(pg_catalog.>) now AND
				(p.owner_session IS NULL OR idempotency._session_alive(p.owner_session)))) THEN
			outcome := 'in_progress';
			held := p.mine;
			lease_until := p.lease_until;
			retry_after := CASE WHEN p.mine THEN 1 ELSE
				LEAST(GREATEST(pg_catalog.ceil(EXTRACT(epoch FROM p.lease_until OPERATOR(pg_catalog.-) now)), 1),
					  2147483647)::integer END;
			RETURN;
		ELSE
			action := 'takeover';
		END IF;

		-- The write's lock_timeout is meant for another transaction's row
		-- of this key only: the table lock is waited for here, as the C
		-- edition waits for it, so that a DDL or LOCK TABLE in progress
		-- never reads as a busy key.
		LOCK TABLE idempotency.keys IN ROW EXCLUSIVE MODE;
		-- another backend is in this key's critical section right now
		IF NOT pg_catalog.pg_try_advisory_lock(idempotency._lock_class(), h) THEN
			outcome := 'in_progress'; retry_after := 1; busy := true;
			RETURN;
		END IF;
		BEGIN
			-- under the lock nobody else starts changing the key: look again
			SELECT * INTO p FROM idempotency._probe(p_scope, p_key);
			IF p.busy THEN
				action := 'busy';
			ELSIF NOT p.present AND NOT idempotency._mark_insert(h) THEN
				-- another transaction is inserting the key
				action := 'busy';
				PERFORM pg_catalog.set_config('idempotency_sql.unseen_insert', 'on', true);
			ELSIF NOT p.present OR p.expires_at OPERATOR(pg_catalog.<=) now THEN
				action := 'fresh';
			ELSIF p.fingerprint IS DISTINCT FROM p_fp OR p.status OPERATOR(pg_catalog.<>) 'pending' OR
				  (p.token IS NOT NULL AND
				   (idempotency._held_here(p.mine, p.token) OR
					(p.lease_until OPERATOR(pg_catalog.>) now AND
					 (p.owner_session IS NULL OR idempotency._session_alive(p.owner_session))))) THEN
				action := 'again';	-- changed since: decide once more
			ELSE
				action := 'takeover';
			END IF;
			IF action IN ('fresh', 'takeover') THEN
				owner := CASE WHEN p_session_bound THEN idempotency._session_binding() END;
				lease := COALESCE(p_lease,
					idempotency._guc_interval('idempotency.lease', 'ms', '00:00:30'));
				retention := COALESCE(p_retention,
					idempotency._guc_interval('idempotency.retention', 's', '24:00:00'));
				lease_until := now OPERATOR(pg_catalog.+) lease;
				expires := GREATEST(now OPERATOR(pg_catalog.+) retention, lease_until);
				token := pg_catalog.nextval('idempotency.token_seq'::regclass);
				new_attempt := CASE WHEN action OPERATOR(pg_catalog.=) 'fresh' THEN 1
					ELSE p.attempt OPERATOR(pg_catalog.+) 1 END;
				IF NOT idempotency._write_claim(p_scope, p_key,
						CASE WHEN p.present THEN p.tid END, token, new_attempt, p_fp,
						CASE WHEN action OPERATOR(pg_catalog.=) 'fresh' THEN now ELSE p.created_at END,
						now, lease_until, expires, retention,
						LEAST(p.sweep_at, lease_until),
						action OPERATOR(pg_catalog.=) 'takeover', owner) THEN
					-- the version probed was replaced by a change that
					-- committed since (see _probe): decide once more
					RAISE EXCEPTION 'version gone' USING ERRCODE = 'IDW03';
				END IF;
				IF pg_catalog.current_setting('idempotency_sql.xact_first_token', true) IS NULL OR
				   pg_catalog.current_setting('idempotency_sql.xact_first_token', true) OPERATOR(pg_catalog.=) '' THEN
					PERFORM pg_catalog.set_config('idempotency_sql.xact_first_token', token::text, true);
				END IF;
				outcome := 'claimed';
				attempt := new_attempt;
				IF action OPERATOR(pg_catalog.=) 'takeover' THEN
					phase := p.phase;
					phase_data := p.phase_data;
				END IF;
				lease_until := NULL;
			END IF;
		EXCEPTION
			WHEN lock_not_available THEN
				-- A wait for another transaction's row names that row version
				-- ("while inserting index tuple (0,2) in relation ...", in
				-- any language) in the innermost line of the context.  Any
				-- other wait that outlasted the write's 1 ms (the extension
				-- lock of the table or an index, taken while they grow) says
				-- nothing about the key: write again, without counting a
				-- round.
				GET STACKED DIAGNOSTICS ctx = PG_EXCEPTION_CONTEXT;
				IF pg_catalog.split_part(ctx, E'\n', 1) OPERATOR(pg_catalog.~) '[(][0-9]+,[0-9]+[)]' OR
				   stalls OPERATOR(pg_catalog.>=) 1000 THEN
					action := 'busy';
					IF NOT p.present THEN
						-- the insert met another transaction's uncommitted one
						PERFORM pg_catalog.set_config('idempotency_sql.unseen_insert', 'on', true);
					END IF;
				ELSE
					action := 'again';
					stalls := stalls OPERATOR(pg_catalog.+) 1;
					round := round OPERATOR(pg_catalog.-) 1;
				END IF;
			WHEN unique_violation OR SQLSTATE 'IDW03' THEN
				IF pg_catalog.current_setting('transaction_isolation') OPERATOR(pg_catalog.<>) 'read committed' THEN
					PERFORM pg_catalog.pg_advisory_unlock(idempotency._lock_class(), h);
					RAISE EXCEPTION 'could not serialize access due to concurrent update of an idempotency key'
						USING ERRCODE = '40001', HINT = 'Retry the transaction.';
				END IF;
				action := 'again';
				-- a version replaced under the probe is no round of its own:
				-- the change that replaced it has committed, and the next
				-- probe sees it
				IF SQLSTATE OPERATOR(pg_catalog.=) 'IDW03' AND stalls OPERATOR(pg_catalog.<) 1000 THEN
					stalls := stalls OPERATOR(pg_catalog.+) 1;
					round := round OPERATOR(pg_catalog.-) 1;
				END IF;
			WHEN OTHERS OR query_canceled THEN
				PERFORM pg_catalog.pg_advisory_unlock(idempotency._lock_class(), h);
				RAISE;
		END;
		PERFORM pg_catalog.pg_advisory_unlock(idempotency._lock_class(), h);
		IF outcome OPERATOR(pg_catalog.=) 'claimed' AND p_flush THEN
			PERFORM idempotency._flush_tokens();
		END IF;
		IF action OPERATOR(pg_catalog.=) 'busy' THEN
			outcome := 'in_progress'; retry_after := 1; busy := true;
			token := NULL; attempt := NULL; phase := NULL; phase_data := NULL;
			RETURN;
		END IF;
		IF outcome IS NOT NULL THEN
			RETURN;
		END IF;
	END LOOP;
	outcome := 'in_progress'; retry_after := 1; busy := true;
END;
$$;

/*
 * idem_claim: check the arguments, claim, and with "wait" poll until the
 * attempt in flight settles or its lease ends (the SQL edition cannot be
 * woken: it polls, 1 ms at first, backing off to 10 ms).
 */
CREATE OR REPLACE FUNCTION idempotency.idem_claim(
	key			text,
	request		jsonb		DEFAULT NULL,
	scope		text		DEFAULT '',
	lease		interval	DEFAULT NULL,
	retention	interval	DEFAULT NULL,
	wait		interval	DEFAULT '0',
	session_bound boolean	DEFAULT false)
RETURNS SETOF idempotency.claim_result
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE ROWS 1
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
	w record;
	deadline timestamptz;
	now timestamptz;
	pause double precision := 0.001;
	sleep double precision;
	insert_at timestamptz;
	insert_every interval := '250 milliseconds';
BEGIN
	PERFORM idempotency._check_name(key, 'key', false);
	PERFORM idempotency._check_name(scope, 'scope', true);
	PERFORM idempotency._check_positive(lease, 'lease');
	PERFORM idempotency._check_positive(retention, 'retention');
	wait := idempotency._check_wait(wait);
	IF session_bound IS NULL THEN
		RAISE EXCEPTION 'session_bound must not be null' USING ERRCODE = '22004';
	END IF;
	PERFORM idempotency._check_writable('idem_claim()');
	PERFORM pg_catalog.set_config('idempotency_sql.unseen_insert', '', true);
	SELECT * INTO w FROM idempotency._w_claim(current_user, 'idem_claim()', key, request,
		scope, lease, retention, session_bound, true);
	IF w.outcome OPERATOR(pg_catalog.=) 'in_progress' AND NOT w.held
	   AND wait OPERATOR(pg_catalog.>) '0'::interval THEN
		deadline := pg_catalog.clock_timestamp() OPERATOR(pg_catalog.+) wait;
		-- A key that another transaction is inserting is invisible, and each
		-- insert of ours waits up to 1 ms for it in the unique check.  Once
		-- an insert met one, polls only probe (the key shows up when that
		-- transaction commits) and insert again only now and then (it
		-- may roll back): after 250 ms, then at doubling intervals up to 1 s.
		IF pg_catalog.current_setting('idempotency_sql.unseen_insert', true) OPERATOR(pg_catalog.=) 'on' THEN
			insert_at := pg_catalog.clock_timestamp() OPERATOR(pg_catalog.+) insert_every;
		END IF;
		LOOP
			now := pg_catalog.clock_timestamp();
			EXIT WHEN now OPERATOR(pg_catalog.>=) deadline;
			sleep := LEAST(pause, EXTRACT(epoch FROM deadline OPERATOR(pg_catalog.-) now)::double precision);
			IF w.lease_until IS NOT NULL AND w.lease_until OPERATOR(pg_catalog.>) now THEN
				sleep := LEAST(sleep, EXTRACT(epoch FROM w.lease_until OPERATOR(pg_catalog.-) now)::double precision);
			END IF;
			PERFORM pg_catalog.pg_sleep(GREATEST(sleep, 0.0005));
			pause := LEAST(pause OPERATOR(pg_catalog.*) 2, 0.01);
			IF insert_at IS NOT NULL AND pg_catalog.clock_timestamp() OPERATOR(pg_catalog.<) insert_at THEN
				PERFORM pg_catalog.set_config('idempotency_sql.probe_only', 'on', true);
			ELSIF insert_at IS NOT NULL THEN
				insert_every := LEAST(insert_every OPERATOR(pg_catalog.*) 2, '1 second'::interval);
				insert_at := pg_catalog.clock_timestamp() OPERATOR(pg_catalog.+) insert_every;
			END IF;
			PERFORM pg_catalog.set_config('idempotency_sql.unseen_insert', '', true);
			-- (an error rolls the transaction-local settings back with it)
			SELECT * INTO w FROM idempotency._w_claim(current_user, 'idem_claim()', key, request,
				scope, lease, retention, session_bound, true);
			PERFORM pg_catalog.set_config('idempotency_sql.probe_only', '', true);
			IF insert_at IS NULL AND
			   pg_catalog.current_setting('idempotency_sql.unseen_insert', true) OPERATOR(pg_catalog.=) 'on' THEN
				insert_at := pg_catalog.clock_timestamp() OPERATOR(pg_catalog.+) insert_every;
			END IF;
			EXIT WHEN w.outcome OPERATOR(pg_catalog.<>) 'in_progress' OR w.held;
		END LOOP;
	END IF;
	RETURN NEXT ROW(w.outcome, w.token, w.attempt, w.status, w.response_code,
		w.response_body, w.retry_after, w.phase, w.phase_data)::idempotency.claim_result;
END;
$$;

/*
 * idem_claim_many: every argument checked first, then each element claimed
 * as idem_claim (without wait) would, one after another.
 */
CREATE OR REPLACE FUNCTION idempotency.idem_claim_many(
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
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE ROWS 100
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
	k text[];
	req jsonb[];
	n integer;
	w record;
	claimed boolean := false;
	no_marks text;
BEGIN
	PERFORM idempotency._check_array(pg_catalog.array_ndims(keys), 'keys', true, keys IS NULL);
	PERFORM idempotency._check_array(pg_catalog.array_ndims(requests), 'requests', false, requests IS NULL);
	k := ARRAY(SELECT u FROM pg_catalog.unnest(keys) u);
	n := pg_catalog.cardinality(k);
	IF requests IS NOT NULL THEN
		req := ARRAY(SELECT u FROM pg_catalog.unnest(requests) u);
		PERFORM idempotency._check_batch_length(pg_catalog.cardinality(req), 'requests', n);
	END IF;
	FOR i IN 1..n LOOP
		PERFORM idempotency._check_name(k[i], pg_catalog.format('keys[%s]', i), false);
	END LOOP;
	PERFORM idempotency._check_name(scope, 'scope', true);
	PERFORM idempotency._check_positive(lease, 'lease');
	PERFORM idempotency._check_positive(retention, 'retention');
	IF session_bound IS NULL THEN
		RAISE EXCEPTION 'session_bound must not be null' USING ERRCODE = '22004';
	END IF;
	PERFORM idempotency._check_writable('idem_claim_many()');
	PERFORM idempotency._tenant_check(current_user, scope);
	-- a batch marks all its fresh keys or none (_mark_insert)
	IF n OPERATOR(pg_catalog.>) (16 OPERATOR(pg_catalog.-)
		COALESCE(NULLIF(pg_catalog.current_setting('idempotency_sql.marks', true), '')::integer, 0)) THEN
		no_marks := COALESCE(pg_catalog.current_setting('idempotency_sql.no_marks', true), '');
		PERFORM pg_catalog.set_config('idempotency_sql.no_marks', 'on', true);
	END IF;
	FOR i IN 1..n LOOP
		SELECT * INTO w FROM idempotency._w_claim(current_user, 'idem_claim_many()', k[i], req[i],
			scope, lease, retention, session_bound, false);
		claimed := claimed OR w.outcome OPERATOR(pg_catalog.=) 'claimed';
		ord := i; key := k[i]; outcome := w.outcome; token := w.token;
		attempt := w.attempt; status := w.status; response_code := w.response_code;
		response_body := w.response_body; retry_after := w.retry_after;
		phase := w.phase; phase_data := w.phase_data;
		RETURN NEXT;
	END LOOP;
	IF no_marks IS NOT NULL THEN
		PERFORM pg_catalog.set_config('idempotency_sql.no_marks', no_marks, true);
	END IF;
	-- the rows leave when the function returns: one flush for all tokens
	IF claimed THEN
		PERFORM idempotency._flush_tokens();
	END IF;
END;
$$;

/* ---------------------------------------------------------------------
 * The calls that present a token (holder.c)
 * ---------------------------------------------------------------------
 */

/*
 * How another transaction holds the row version at "t", told by the row
 * locks that conflict with its hold, each asked without waiting in one
 * subtransaction that is rolled back at once (so nothing stays locked):
 *   'exclusive'  a delete or FOR UPDATE (FOR KEY SHARE conflicts);
 *   'update'     an update of other columns than the key, or FOR NO KEY
 *                UPDATE, which cannot be told from one (FOR SHARE
 *                conflicts, FOR KEY SHARE does not);
 *   'shared'     only shared row locks (FOR UPDATE conflicts);
 *   'free'       nothing;
 *   'gone'       the version is no longer there: a change committed since
 *                it was read, so the caller reads the key again.
 */
CREATE OR REPLACE FUNCTION idempotency._row_hold(t tid)
RETURNS text
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
	asking text := 'exclusive';
	verdict text := 'gone';
BEGIN
	BEGIN
		PERFORM FROM idempotency.keys k WHERE k.ctid OPERATOR(pg_catalog.=) t
			FOR KEY SHARE NOWAIT;
		IF FOUND THEN
			asking := 'update';
			PERFORM FROM idempotency.keys k WHERE k.ctid OPERATOR(pg_catalog.=) t
				FOR SHARE NOWAIT;
			IF FOUND THEN
				asking := 'shared';
				PERFORM FROM idempotency.keys k WHERE k.ctid OPERATOR(pg_catalog.=) t
					FOR UPDATE NOWAIT;
				IF FOUND THEN
					verdict := 'free';
				END IF;
			END IF;
		END IF;
		RAISE EXCEPTION 'asked' USING ERRCODE = 'IDW02';
	EXCEPTION
		WHEN lock_not_available THEN
			RETURN asking;
		WHEN SQLSTATE 'IDW02' THEN
			RETURN verdict;
	END;
END;
$$;

-- versions before 1.6.3 asked the same in two functions: an update drops
-- them (without a notice on a fresh install)
DO $do$
BEGIN
	IF pg_catalog.to_regprocedure('idempotency._row_locked(tid)') IS NOT NULL THEN
		DROP FUNCTION idempotency._row_locked(tid);
	END IF;
	IF pg_catalog.to_regprocedure('idempotency._being_updated(tid)') IS NOT NULL THEN
		DROP FUNCTION idempotency._being_updated(tid);
	END IF;
END;
$do$;

/*
 * One token holder's call: finish, extend, release or checkpoint the key.
 * Judges the token against the key's committed row (absent or past its
 * retention: P0002; finished: 55000; another token's: 55006), then locks
 * the row without waiting (another transaction changing or locking it:
 * 55P03) and writes.  Returns the key's expiry (finish), the new lease end
 * (extend), or NULL.  A finish repeated with the token that finished the
 * key answers that finish's expiry and writes nothing.
 */
CREATE OR REPLACE FUNCTION idempotency._w_token_call(caller name, kind text,
	p_key text, p_token bigint, p_scope text, p_code integer, p_body jsonb,
	p_status text, p_interval interval, p_phase text,
	OUT result timestamptz, OUT wrote boolean)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
	fn text := 'idem_' OPERATOR(pg_catalog.||) kind OPERATOR(pg_catalog.||) '()';
	now timestamptz;
	p record;
	h integer;
	disp text;
	locked tid;
	n bigint;
	step text;
	hold text;
	row_held boolean;
	gone integer := 0;
BEGIN
	IF kind IS NULL OR kind OPERATOR(pg_catalog.<>) ALL (ARRAY['finish', 'extend', 'release', 'checkpoint']) THEN
		RAISE EXCEPTION 'unknown token call "%"', kind USING ERRCODE = '22023';
	END IF;
	PERFORM idempotency._check_name(p_key, 'key', false);
	PERFORM idempotency._check_name(p_scope, 'scope', true);
	IF p_token IS NULL THEN
		RAISE EXCEPTION 'token must not be null' USING ERRCODE = '22004';
	END IF;
	IF kind OPERATOR(pg_catalog.=) 'finish' THEN
		PERFORM idempotency._check_body(p_body, 'response_body');
		PERFORM idempotency._check_status(p_status);
		PERFORM idempotency._check_positive(p_interval, 'retention');
	ELSIF kind OPERATOR(pg_catalog.=) 'extend' THEN
		PERFORM idempotency._check_positive(p_interval, 'lease');
	ELSIF kind OPERATOR(pg_catalog.=) 'checkpoint' THEN
		PERFORM idempotency._check_name(p_phase, 'phase', false);
		PERFORM idempotency._check_body(p_body, 'data');
	END IF;
	PERFORM idempotency._check_writable(fn);
	PERFORM idempotency._tenant_check(caller, p_scope);
	PERFORM idempotency._check_catalog();
	wrote := false;
	h := idempotency._key_hash(p_scope, p_key);
	disp := idempotency._key_display(p_scope, p_key);
	LOOP
		PERFORM pg_catalog.pg_advisory_lock(idempotency._lock_class(), h);
		BEGIN
			now := pg_catalog.clock_timestamp();
			SELECT * INTO p FROM idempotency._probe(p_scope, p_key);
			step := 'go';
			row_held := false;
			-- Another transaction is changing a key whose committed row is
			-- this token's claim.  Without a dirty read the SQL edition
			-- cannot see the new version, so it tells the change by the row
			-- lock it holds, asked without waiting.  While the lease runs,
			-- only the token's holder (an extend, checkpoint, finish or
			-- release made elsewhere), a sweep moving sweep_at, or plain SQL
			-- changes the key: an update of other columns than the key
			-- leaves the token current and is waited for, as a row lock
			-- waits (so a deadlock is detected), without the key's lock,
			-- and the key is read again.  A delete (a release) or a plain
			-- row lock is not waited for, and neither is any change once
			-- the lease has ended (it may be a takeover): a lock still held
			-- then refuses the call (55P03 below).  The probe's "busy" may
			-- be stale (that transaction has ended) or read from a
			-- transaction id that only looks running (an aborted row lock's
			-- id that is also a live multixact's number), so the lock is
			-- asked of the row itself; a version that is gone by then was
			-- replaced by a change that has committed: read again.
			IF p.busy AND p.present AND p.status OPERATOR(pg_catalog.=) 'pending'
			   AND p.token OPERATOR(pg_catalog.=) p_token
			   AND p.expires_at OPERATOR(pg_catalog.>) now THEN
				hold := idempotency._row_hold(p.tid);
				IF hold OPERATOR(pg_catalog.=) 'gone' THEN
					step := 'again';
				ELSIF hold OPERATOR(pg_catalog.=) 'update'
				   AND p.lease_until OPERATOR(pg_catalog.>) now
				   AND (p.owner_session IS NULL OR idempotency._session_alive(p.owner_session)) THEN
					step := 'wait';
				ELSE
					row_held := hold OPERATOR(pg_catalog.<>) 'free';
				END IF;
			END IF;
			IF step OPERATOR(pg_catalog.=) 'go' THEN
				-- what the committed row says is said whatever is in flight
				IF NOT p.present OR p.expires_at OPERATOR(pg_catalog.<=) now THEN
					RAISE EXCEPTION 'idempotency key % does not exist', disp
						USING ERRCODE = 'P0002',
							  DETAIL = 'It was never claimed, was released, or its retention has passed.';
				END IF;
				IF p.status OPERATOR(pg_catalog.<>) 'pending' THEN
					IF kind OPERATOR(pg_catalog.=) 'finish' AND p.token OPERATOR(pg_catalog.=) p_token THEN
						result := p.expires_at;
					ELSE
						RAISE EXCEPTION 'idempotency key % is already finished', disp
							USING ERRCODE = '55000',
								  DETAIL = CASE WHEN kind OPERATOR(pg_catalog.=) 'finish'
									THEN 'Another attempt stored its result.'
									ELSE pg_catalog.format('Its status is "%s".', p.status) END;
					END IF;
				ELSIF p.token IS DISTINCT FROM p_token THEN
					RAISE EXCEPTION 'token % is not the current token of idempotency key %', p_token, disp
						USING ERRCODE = '55006',
							  DETAIL = CASE WHEN p.token IS NOT NULL
								THEN pg_catalog.format('Attempt %s holds the key now.', p.attempt)
								ELSE 'The sweeper reset the key after its lease ended.' END,
							  HINT = 'Another attempt took the claim over, or this token never held it: do not store this attempt''s result.';
				END IF;
			END IF;
			IF step OPERATOR(pg_catalog.=) 'go' AND result IS NULL THEN
				-- the token is current
				IF row_held THEN
					RAISE EXCEPTION 'could not % idempotency key %', kind, disp
						USING ERRCODE = '55P03',
							  DETAIL = 'Another transaction holds a row lock on this key.',
							  HINT = 'Retry once that transaction has ended.';
				END IF;
				-- every writer of the key holds its advisory lock, which we hold:
				-- the version probed is the one to write (no row lock, which
				-- would stay on the new version and look like a change in flight)
				locked := p.tid;
				IF kind OPERATOR(pg_catalog.=) 'finish' THEN
					result := now OPERATOR(pg_catalog.+) COALESCE(p_interval, p.retention);
					UPDATE idempotency.keys k
					   SET status = p_status, response_code = p_code,
						   response_body = p_body, finished_at = now,
						   lease_until = NULL, expires_at = result,
						   sweep_at = LEAST(p.sweep_at, result), owner_session = NULL
					 WHERE k.ctid OPERATOR(pg_catalog.=) locked;
				ELSIF kind OPERATOR(pg_catalog.=) 'extend' THEN
					result := now OPERATOR(pg_catalog.+) COALESCE(p_interval,
						idempotency._guc_interval('idempotency.lease', 'ms', '00:00:30'));
					UPDATE idempotency.keys k
					   SET lease_until = result,
						   expires_at = GREATEST(now OPERATOR(pg_catalog.+) p.retention, result)
					 WHERE k.ctid OPERATOR(pg_catalog.=) locked;
				ELSIF kind OPERATOR(pg_catalog.=) 'release' THEN
					DELETE FROM idempotency.keys k WHERE k.ctid OPERATOR(pg_catalog.=) locked;
				ELSE
					UPDATE idempotency.keys k
					   SET phase = p_phase, phase_data = p_body
					 WHERE k.ctid OPERATOR(pg_catalog.=) locked;
				END IF;
				GET DIAGNOSTICS n = ROW_COUNT;
				IF n OPERATOR(pg_catalog.=) 1 THEN
					wrote := true;
				ELSIF pg_catalog.current_setting('transaction_isolation') OPERATOR(pg_catalog.<>) 'read committed' OR
					  gone OPERATOR(pg_catalog.>=) 100 THEN
					RAISE EXCEPTION 'idempotency key changed during a write'
						USING ERRCODE = '40001',
							  DETAIL = 'Someone changed idempotency.keys outside the extension''s functions.',
							  HINT = 'Retry the transaction.';
				ELSE
					-- The version probed was replaced by a change that
					-- committed since (see _probe): read the key again.  The
					-- statement locked the newest version while it looked for
					-- ours: roll that lock back, or a sweep that waits for it
					-- while it holds the key's lock would wait for us, and we
					-- for it.
					RAISE EXCEPTION 'version gone' USING ERRCODE = 'IDW03';
				END IF;
			END IF;
		EXCEPTION
			WHEN SQLSTATE 'IDW03' THEN
				gone := gone OPERATOR(pg_catalog.+) 1;
				result := NULL;
				step := 'again';
			WHEN lock_not_available THEN
				PERFORM pg_catalog.pg_advisory_unlock(idempotency._lock_class(), h);
				RAISE EXCEPTION 'could not % idempotency key %', kind, disp
					USING ERRCODE = '55P03',
						  DETAIL = 'Another transaction holds a row lock on this key.',
						  HINT = 'Retry once that transaction has ended.';
			WHEN OTHERS OR query_canceled THEN
				PERFORM pg_catalog.pg_advisory_unlock(idempotency._lock_class(), h);
				RAISE;
		END;
		PERFORM pg_catalog.pg_advisory_unlock(idempotency._lock_class(), h);
		EXIT WHEN step OPERATOR(pg_catalog.=) 'go';
		IF step OPERATOR(pg_catalog.=) 'wait' THEN
			-- Wait as a row lock waits, so that a deadlock is detected.
			-- The lock is held for an instant once the wait is over, and
			-- another token call of the key may see it: FOR NO KEY UPDATE
			-- reads there as an update and is waited for in turn, where
			-- FOR SHARE would read as a plain row lock and refuse that
			-- call.
			BEGIN
				PERFORM FROM idempotency.keys k WHERE k.ctid OPERATOR(pg_catalog.=) p.tid
					FOR NO KEY UPDATE;
				-- the lock only served to wait: roll it back at once
				RAISE EXCEPTION 'waited' USING ERRCODE = 'IDW01';
			EXCEPTION WHEN SQLSTATE 'IDW01' THEN
				NULL;
			END;
		END IF;
	END LOOP;
END;
$$;

CREATE OR REPLACE FUNCTION idempotency.idem_finish(
	key				text,
	token			bigint,
	response_code	integer		DEFAULT NULL,
	response_body	jsonb		DEFAULT NULL,
	scope			text		DEFAULT '',
	status			text		DEFAULT 'succeeded',
	retention		interval	DEFAULT NULL)
RETURNS timestamptz
LANGUAGE sql VOLATILE PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
RETURN (SELECT w.result FROM idempotency._w_token_call(current_user, 'finish', key,
	token, scope, response_code, response_body, status, retention, NULL) w);

CREATE OR REPLACE FUNCTION idempotency.idem_extend(
	key		text,
	token	bigint,
	lease	interval	DEFAULT NULL,
	scope	text		DEFAULT '')
RETURNS timestamptz
LANGUAGE sql VOLATILE PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
RETURN (SELECT w.result FROM idempotency._w_token_call(current_user, 'extend', key,
	token, scope, NULL, NULL, NULL, lease, NULL) w);

CREATE OR REPLACE FUNCTION idempotency.idem_release(
	key		text,
	token	bigint,
	scope	text	DEFAULT '')
RETURNS void
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
	PERFORM idempotency._w_token_call(current_user, 'release', key, token, scope,
		NULL, NULL, NULL, NULL, NULL);
END;
$$;

/*
 * A recovery point: the current attempt completed the step "phase"; "data"
 * is what a successor needs to resume after it.  Made in the transaction
 * of the step's own writes, the step and its checkpoint commit together.
 */
CREATE OR REPLACE FUNCTION idempotency.idem_checkpoint(
	key		text,
	token	bigint,
	phase	text,
	data	jsonb	DEFAULT NULL,
	scope	text	DEFAULT '')
RETURNS void
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
	PERFORM idempotency._w_token_call(current_user, 'checkpoint', key, token, scope,
		NULL, data, NULL, NULL, phase);
END;
$$;

/*
 * idem_finish_many: every argument checked first, then each key finished
 * as idem_finish would; the first refusal raises its error, which undoes
 * the elements finished before it.
 */
CREATE OR REPLACE FUNCTION idempotency.idem_finish_many(
	keys			text[],
	tokens			bigint[],
	response_codes	integer[]	DEFAULT NULL,
	response_bodies	jsonb[]		DEFAULT NULL,
	scope			text		DEFAULT '',
	status			text		DEFAULT 'succeeded',
	retention		interval	DEFAULT NULL)
RETURNS TABLE (ord integer, key text, expires_at timestamptz)
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE ROWS 100
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
	k text[];
	t bigint[];
	c integer[];
	b jsonb[];
	n integer;
	e_state text;
	e_message text;
	e_detail text;
	e_hint text;
BEGIN
	PERFORM idempotency._check_array(pg_catalog.array_ndims(keys), 'keys', true, keys IS NULL);
	PERFORM idempotency._check_array(pg_catalog.array_ndims(tokens), 'tokens', true, tokens IS NULL);
	PERFORM idempotency._check_array(pg_catalog.array_ndims(response_codes), 'response_codes', false, response_codes IS NULL);
	PERFORM idempotency._check_array(pg_catalog.array_ndims(response_bodies), 'response_bodies', false, response_bodies IS NULL);
	k := ARRAY(SELECT u FROM pg_catalog.unnest(keys) u);
	t := ARRAY(SELECT u FROM pg_catalog.unnest(tokens) u);
	n := pg_catalog.cardinality(k);
	PERFORM idempotency._check_batch_length(pg_catalog.cardinality(t), 'tokens', n);
	IF response_codes IS NOT NULL THEN
		c := ARRAY(SELECT u FROM pg_catalog.unnest(response_codes) u);
		PERFORM idempotency._check_batch_length(pg_catalog.cardinality(c), 'response_codes', n);
	END IF;
	IF response_bodies IS NOT NULL THEN
		b := ARRAY(SELECT u FROM pg_catalog.unnest(response_bodies) u);
		PERFORM idempotency._check_batch_length(pg_catalog.cardinality(b), 'response_bodies', n);
	END IF;
	FOR i IN 1..n LOOP
		PERFORM idempotency._check_name(k[i], pg_catalog.format('keys[%s]', i), false);
	END LOOP;
	FOR i IN 1..n LOOP
		IF t[i] IS NULL THEN
			RAISE EXCEPTION 'tokens[%] must not be null', i USING ERRCODE = '22004';
		END IF;
		IF b IS NOT NULL THEN
			PERFORM idempotency._check_body(b[i], pg_catalog.format('response_bodies[%s]', i));
		END IF;
	END LOOP;
	PERFORM idempotency._check_name(scope, 'scope', true);
	PERFORM idempotency._check_status(status);
	PERFORM idempotency._check_positive(retention, 'retention');
	PERFORM idempotency._check_writable('idem_finish_many()');
	-- One block for the whole loop (a block per element would open a
	-- subtransaction per key): the element that fails is in ord and key.
	BEGIN
		FOR i IN 1..n LOOP
			ord := i;
			key := k[i];
			SELECT w.result INTO expires_at
			  FROM idempotency._w_token_call(current_user, 'finish', k[i], t[i], scope,
				   c[i], b[i], status, retention, NULL) w;
			RETURN NEXT;
		END LOOP;
	EXCEPTION WHEN OTHERS THEN
		-- the element's position and key before the message, every other
		-- field as idem_finish raises it (a cancel is not caught: it is
		-- about the statement, not an element)
		GET STACKED DIAGNOSTICS e_state = RETURNED_SQLSTATE, e_message = MESSAGE_TEXT,
			e_detail = PG_EXCEPTION_DETAIL, e_hint = PG_EXCEPTION_HINT;
		PERFORM idempotency._raise(e_state,
			pg_catalog.format('idem_finish_many element %s, key %s: %s', ord,
				idempotency._key_display(scope, key), e_message),
			e_detail, e_hint);
	END;
END;
$$;

/* ---------------------------------------------------------------------
 * Reading (lookup.c)
 * ---------------------------------------------------------------------
 */

CREATE OR REPLACE FUNCTION idempotency._w_lookup(caller name, p_key text, p_scope text)
RETURNS TABLE (status text, attempt integer, response_code integer,
			   response_body jsonb, created_at timestamptz,
			   finished_at timestamptz, expires_at timestamptz,
			   phase text)
LANGUAGE plpgsql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
	PERFORM idempotency._check_name(p_key, 'key', false);
	PERFORM idempotency._check_name(p_scope, 'scope', true);
	PERFORM idempotency._tenant_check(caller, p_scope);
	PERFORM idempotency._check_catalog();
	RETURN QUERY
		SELECT k.status::text, k.attempt, k.response_code, k.response_body,
			   k.created_at, k.finished_at, k.expires_at, k.phase::text
		  FROM idempotency.keys k,
			   LATERAL idempotency._check_row(p_scope, p_key, k.status, k.attempt,
				   k.created_at, k.expires_at, k.retention, k.sweep_at, k.fingerprint) c
		 WHERE k.scope OPERATOR(pg_catalog.=) p_scope
		   AND k.key OPERATOR(pg_catalog.=) p_key
		   AND k.expires_at OPERATOR(pg_catalog.>) pg_catalog.clock_timestamp();
END;
$$;

CREATE OR REPLACE FUNCTION idempotency.idem_lookup(
	key		text,
	scope	text	DEFAULT '')
RETURNS TABLE (status text, attempt integer, response_code integer,
			   response_body jsonb, created_at timestamptz,
			   finished_at timestamptz, expires_at timestamptz,
			   phase text)
LANGUAGE sql STABLE PARALLEL RESTRICTED ROWS 1
SET search_path = pg_catalog, pg_temp
AS $$
	SELECT * FROM idempotency._w_lookup(current_user, key, scope);
$$;

/* ---------------------------------------------------------------------
 * Sweeping (sweep.c)
 * ---------------------------------------------------------------------
 */

/*
 * Sweep one candidate row version "t" of (scope, key): skipped when its
 * lock is taken, when another transaction is changing or locking it, when
 * our own open transaction is claiming it, or when it changed since the
 * candidate query.  Returns 'expired', 'reset', 'rescheduled' or NULL.
 * "only_ended": a key of a session that ended that needs neither a delete
 * nor a reset is left alone.
 */
CREATE OR REPLACE FUNCTION idempotency._sweep_one(t tid, p_scope text, p_key text,
	now timestamptz, do_expire boolean, do_reset boolean, only_ended boolean)
RETURNS text
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
	h integer := idempotency._key_hash(p_scope, p_key);
	p record;
	runs boolean;
	done text;
	n bigint;
BEGIN
	IF NOT pg_catalog.pg_try_advisory_lock(idempotency._lock_class(), h) THEN
		RETURN NULL;
	END IF;
	BEGIN
		SELECT * INTO p FROM idempotency._probe(p_scope, p_key);
		IF p.present AND NOT p.busy AND p.tid OPERATOR(pg_catalog.=) t
		   AND NOT (p.mine AND p.status OPERATOR(pg_catalog.=) 'pending') THEN
			runs := p.status OPERATOR(pg_catalog.=) 'pending' AND p.token IS NOT NULL AND
				p.lease_until OPERATOR(pg_catalog.>) now AND
				(p.owner_session IS NULL OR idempotency._session_alive(p.owner_session));
			IF p.expires_at OPERATOR(pg_catalog.<=) now AND NOT runs THEN
				IF do_expire THEN
					DELETE FROM idempotency.keys k
					 WHERE k.ctid OPERATOR(pg_catalog.=) t;
					GET DIAGNOSTICS n = ROW_COUNT;
					done := 'expired';
				END IF;
			ELSIF p.status OPERATOR(pg_catalog.=) 'pending' AND p.token IS NOT NULL AND NOT runs THEN
				IF do_reset THEN
					UPDATE idempotency.keys k
					   SET token = NULL, sweep_at = p.expires_at, owner_session = NULL
					 WHERE k.ctid OPERATOR(pg_catalog.=) t;
					GET DIAGNOSTICS n = ROW_COUNT;
					done := 'reset';
				END IF;
			ELSIF NOT only_ended THEN
				UPDATE idempotency.keys k
				   SET sweep_at = CASE WHEN runs THEN p.lease_until ELSE p.expires_at END
				 WHERE k.ctid OPERATOR(pg_catalog.=) t;
				GET DIAGNOSTICS n = ROW_COUNT;
				done := 'rescheduled';
			END IF;
			IF n OPERATOR(pg_catalog.=) 0 THEN
				-- the version was replaced by a change that committed since
				-- the probe: skipped, and the lock the statement took on the
				-- newest version while it looked for ours is rolled back
				RAISE EXCEPTION 'version gone' USING ERRCODE = 'IDW03';
			END IF;
		END IF;
	EXCEPTION
		WHEN serialization_failure OR SQLSTATE 'IDW03' THEN
			done := NULL;		-- changed since our snapshot: skipped
		WHEN OTHERS OR query_canceled THEN
			PERFORM pg_catalog.pg_advisory_unlock(idempotency._lock_class(), h);
			RAISE;
	END;
	PERFORM pg_catalog.pg_advisory_unlock(idempotency._lock_class(), h);
	RETURN done;
END;
$$;

/*
 * Delete keys past their retention and reset pending keys whose lease
 * ended (or whose session ended), at most batch_size of each kind; keys
 * found before their time are rescheduled on the way.  Never waits: rows
 * that others are changing or locking are skipped.
 */
CREATE OR REPLACE FUNCTION idempotency.idem_sweep(
	batch_size	integer	DEFAULT NULL)
RETURNS TABLE (expired bigint, reset bigint)
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE ROWS 1 SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
	batch integer;
	now timestamptz;
	c record;
	done text;
	progress integer;
	n integer;
	last_owner bigint;
	last_alive boolean;
BEGIN
	IF batch_size IS NOT NULL AND batch_size OPERATOR(pg_catalog.<=) 0 THEN
		RAISE EXCEPTION 'batch_size must be positive' USING ERRCODE = '22023';
	END IF;
	batch := COALESCE(batch_size,
		idempotency._guc_bytes('idempotency.sweep_batch', 1000)::integer);
	PERFORM idempotency._check_writable('idem_sweep()');
	PERFORM idempotency._check_catalog();
	now := pg_catalog.clock_timestamp();
	expired := 0;
	reset := 0;
	LOOP
		progress := 0;
		n := 0;
		FOR c IN
			SELECT k.ctid AS t, k.scope, k.key FROM idempotency.keys k
			 WHERE k.sweep_at OPERATOR(pg_catalog.<=) now
			 ORDER BY k.sweep_at
			 LIMIT LEAST(batch::bigint OPERATOR(pg_catalog.*) 2, 2147483647)
		LOOP
			n := n OPERATOR(pg_catalog.+) 1;
			EXIT WHEN expired OPERATOR(pg_catalog.>=) batch OR reset OPERATOR(pg_catalog.>=) batch;
			done := idempotency._sweep_one(c.t, c.scope, c.key, now,
				expired OPERATOR(pg_catalog.<) batch, reset OPERATOR(pg_catalog.<) batch, false);
			IF done IS NOT NULL THEN
				progress := progress OPERATOR(pg_catalog.+) 1;
			END IF;
			IF done OPERATOR(pg_catalog.=) 'expired' THEN
				expired := expired OPERATOR(pg_catalog.+) 1;
			ELSIF done OPERATOR(pg_catalog.=) 'reset' THEN
				reset := reset OPERATOR(pg_catalog.+) 1;
			END IF;
		END LOOP;
		EXIT WHEN n OPERATOR(pg_catalog.<) LEAST(batch::bigint OPERATOR(pg_catalog.*) 2, 2147483647)
			OR progress OPERATOR(pg_catalog.=) 0
			OR expired OPERATOR(pg_catalog.>=) batch OR reset OPERATOR(pg_catalog.>=) batch;
	END LOOP;
	-- the keys of sessions that ended: found through keys_owner_session_idx
	IF expired OPERATOR(pg_catalog.<) batch AND reset OPERATOR(pg_catalog.<) batch THEN
		FOR c IN
			SELECT k.ctid AS t, k.scope, k.key, k.owner_session FROM idempotency.keys k
			 WHERE k.owner_session IS NOT NULL
			 ORDER BY k.owner_session
		LOOP
			IF c.owner_session IS DISTINCT FROM last_owner THEN
				last_owner := c.owner_session;
				last_alive := idempotency._session_alive(last_owner);
			END IF;
			CONTINUE WHEN last_alive;
			EXIT WHEN expired OPERATOR(pg_catalog.>=) batch OR reset OPERATOR(pg_catalog.>=) batch;
			done := idempotency._sweep_one(c.t, c.scope, c.key, now, true, true, true);
			IF done OPERATOR(pg_catalog.=) 'expired' THEN
				expired := expired OPERATOR(pg_catalog.+) 1;
			ELSIF done OPERATOR(pg_catalog.=) 'reset' THEN
				reset := reset OPERATOR(pg_catalog.+) 1;
			END IF;
		END LOOP;
	END IF;
	RETURN NEXT;
END;
$$;

REVOKE ALL ON FUNCTION idempotency.idem_sweep(integer) FROM PUBLIC;

/*
 * The version of the contract this edition implements, with the C
 * edition's library version number of the same release (filled in by
 * scripts/sql-edition.sh from src/idempotency.h).
 */
CREATE OR REPLACE FUNCTION idempotency.idem_version()
RETURNS text
LANGUAGE sql STABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
RETURN '1.6.4';

/* ---------------------------------------------------------------------
 * Statistics (stats.c)
 * ---------------------------------------------------------------------
 */

/*
 * The call counters live in the C edition's shared memory; the SQL edition
 * has none, so this returns no row and the view's counters are NULL.
 */
CREATE OR REPLACE FUNCTION idempotency.stats_counters(
	OUT dbid oid, OUT claims bigint, OUT takeovers bigint, OUT replays bigint,
	OUT in_progress bigint, OUT mismatches bigint, OUT finishes bigint,
	OUT releases bigint, OUT expired bigint, OUT reset bigint,
	OUT last_sweep_at timestamptz, OUT last_sweep_ms double precision,
	OUT checkpoints bigint)
RETURNS SETOF record
LANGUAGE plpgsql VOLATILE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
	RETURN;
END;
$$;

CREATE OR REPLACE FUNCTION idempotency.stats_reset()
RETURNS void
LANGUAGE plpgsql VOLATILE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
	RETURN;
END;
$$;

REVOKE ALL ON FUNCTION idempotency.stats_reset() FROM PUBLIC;

/*
 * This database's keys by status: counted exactly while the table is small
 * (idempotency.stats_exact_limit blocks, 1024 unless set; -1 always),
 * estimated from the planner's statistics above.  Only for a role that may
 * read the stats view.
 */
CREATE OR REPLACE FUNCTION idempotency._w_stats_key_counts(caller name,
	OUT pending bigint, OUT succeeded bigint, OUT failed bigint,
	OUT exact boolean)
RETURNS record
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
	lim bigint := idempotency._guc_bytes('idempotency.stats_exact_limit', 1024, true);
	blocks bigint;
	tuples double precision;
	pages double precision;
	s record;
BEGIN
	IF pg_catalog.to_regclass('idempotency.stats') IS NULL THEN
		RAISE EXCEPTION 'relation "idempotency.stats" does not exist' USING ERRCODE = '42P01';
	END IF;
	IF NOT pg_catalog.has_table_privilege(caller, 'idempotency.stats', 'SELECT') THEN
		RAISE EXCEPTION 'permission denied for view stats' USING ERRCODE = '42501';
	END IF;
	PERFORM idempotency._check_catalog();
	blocks := pg_catalog.pg_relation_size('idempotency.keys'::regclass) OPERATOR(pg_catalog./)
		pg_catalog.current_setting('block_size')::bigint;
	IF lim OPERATOR(pg_catalog.<) 0 OR blocks OPERATOR(pg_catalog.<=) lim THEN
		SELECT pg_catalog.count(*) FILTER (WHERE k.status OPERATOR(pg_catalog.=) 'pending'),
			   pg_catalog.count(*) FILTER (WHERE k.status OPERATOR(pg_catalog.=) 'succeeded'),
			   pg_catalog.count(*) FILTER (WHERE k.status OPERATOR(pg_catalog.=) 'failed')
		  INTO pending, succeeded, failed
		  FROM idempotency.keys k
		 WHERE k.expires_at OPERATOR(pg_catalog.>) pg_catalog.clock_timestamp();
		exact := true;
		RETURN;
	END IF;
	exact := false;
	SELECT c.reltuples, c.relpages INTO tuples, pages
	  FROM pg_catalog.pg_class c WHERE c.oid OPERATOR(pg_catalog.=) 'idempotency.keys'::regclass;
	SELECT st.most_common_vals::text::text[] AS v, st.most_common_freqs AS f INTO s
	  FROM pg_catalog.pg_stats st
	 WHERE st.schemaname OPERATOR(pg_catalog.=) 'idempotency'
	   AND st.tablename OPERATOR(pg_catalog.=) 'keys'
	   AND st.attname OPERATOR(pg_catalog.=) 'status' AND NOT st.inherited;
	IF NOT FOUND OR tuples OPERATOR(pg_catalog.<) 0 OR pages OPERATOR(pg_catalog.<=) 0 THEN
		RETURN;
	END IF;
	tuples := tuples OPERATOR(pg_catalog./) pages OPERATOR(pg_catalog.*) blocks;
	pending := 0; succeeded := 0; failed := 0;
	FOR i IN 1..COALESCE(pg_catalog.cardinality(s.v), 0) LOOP
		CASE s.v[i]
			WHEN 'pending' THEN pending := pg_catalog.round(tuples OPERATOR(pg_catalog.*) s.f[i]);
			WHEN 'succeeded' THEN succeeded := pg_catalog.round(tuples OPERATOR(pg_catalog.*) s.f[i]);
			WHEN 'failed' THEN failed := pg_catalog.round(tuples OPERATOR(pg_catalog.*) s.f[i]);
			ELSE NULL;
		END CASE;
	END LOOP;
END;
$$;

CREATE OR REPLACE FUNCTION idempotency.stats_key_counts(
	OUT pending bigint, OUT succeeded bigint, OUT failed bigint,
	OUT exact boolean)
RETURNS record
LANGUAGE sql VOLATILE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
	SELECT * FROM idempotency._w_stats_key_counts(current_user);
$$;

CREATE OR REPLACE VIEW idempotency.stats AS
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

/* ---------------------------------------------------------------------
 * Tenant bindings (tenant.c): the table's API
 * ---------------------------------------------------------------------
 */

/*
 * The C edition's trigger tells every backend to reload its cached
 * bindings; the SQL edition reads the table at every call, so there is
 * nothing to tell.  The trigger stays, so that both editions have the same
 * objects.
 */
CREATE OR REPLACE FUNCTION idempotency.scope_bindings_changed()
RETURNS trigger
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
	RETURN NULL;
END;
$$;
REVOKE ALL ON FUNCTION idempotency.scope_bindings_changed() FROM PUBLIC;

CREATE OR REPLACE TRIGGER scope_bindings_changed
	AFTER INSERT OR UPDATE OR DELETE OR TRUNCATE
	ON idempotency.scope_bindings
	FOR EACH STATEMENT EXECUTE FUNCTION idempotency.scope_bindings_changed();

CREATE OR REPLACE FUNCTION idempotency.bind_scope(role regrole, scope_prefix text)
RETURNS void
LANGUAGE sql VOLATILE STRICT
SET search_path = pg_catalog, pg_temp
BEGIN ATOMIC
	INSERT INTO idempotency.scope_bindings AS b (role, scope_prefix)
	VALUES (bind_scope.role, bind_scope.scope_prefix)
	ON CONFLICT (role) DO UPDATE SET scope_prefix = excluded.scope_prefix;
END;

CREATE OR REPLACE FUNCTION idempotency.unbind_scope(role regrole)
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
 * Citus: the SQL edition is not distributed (its functions read the table
 * through SQL, which Citus would route per statement, not per call), so
 * distribute() refuses as the C edition does where Citus is absent.
 */
CREATE OR REPLACE FUNCTION idempotency.distribute(shard_count integer DEFAULT NULL)
RETURNS void
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
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
	RAISE EXCEPTION 'the SQL edition of idempotency cannot be distributed with Citus'
		USING ERRCODE = '0A000',
			  HINT = 'Use the C edition on a Citus cluster.';
END;
$$;
REVOKE ALL ON FUNCTION idempotency.distribute(integer) FROM PUBLIC;

/* This server's row of the stats view (the SQL edition runs without Citus). */
CREATE OR REPLACE FUNCTION idempotency.cluster_stats_rows()
RETURNS TABLE (node text, database name, claims bigint, takeovers bigint,
			   replays bigint, in_progress bigint, mismatches bigint,
			   finishes bigint, releases bigint, expired bigint,
			   reset bigint, last_sweep_at timestamptz,
			   last_sweep_ms double precision, pending bigint,
			   succeeded bigint, failed bigint, key_counts_exact boolean,
			   checkpoints bigint)
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
	RETURN QUERY
		SELECT 'local'::text, s.*
		  FROM idempotency.stats s
		 WHERE s.database OPERATOR(pg_catalog.=) pg_catalog.current_database();
END;
$$;

CREATE OR REPLACE FUNCTION idempotency.cluster_stats_failed(nodename text, nodeport integer,
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

CREATE OR REPLACE VIEW idempotency.cluster_stats AS
SELECT * FROM idempotency.cluster_stats_rows();

GRANT SELECT ON idempotency.cluster_stats TO PUBLIC;
