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

/*
 * Set aside function "fn" (its signature, as to_regprocedure reads it) of
 * an older version when it exists and, if "unless_arg" is given, has no
 * argument of that name (the new version's has one: it stays).  A helper
 * (a name that starts with "_") is dropped, as only the API functions call
 * it.  An API function is renamed _parked_NAME: a view may use it until its
 * part replaces the view, and its owner and privileges go to its successor
 * at the end (_update_take_over).
 */
CREATE OR REPLACE FUNCTION idempotency._update_set_aside(fn text, unless_arg text DEFAULT NULL)
RETURNS void
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
	f regprocedure := pg_catalog.to_regprocedure(fn);
	p record;
BEGIN
	IF f IS NULL THEN
		RETURN;
	END IF;
	SELECT pr.proname, pr.proargnames INTO p
	  FROM pg_catalog.pg_proc pr WHERE pr.oid OPERATOR(pg_catalog.=) f;
	IF unless_arg OPERATOR(pg_catalog.=) ANY (p.proargnames) THEN
		RETURN;
	END IF;
	IF pg_catalog.starts_with(p.proname::text, '_') THEN
		EXECUTE pg_catalog.format('DROP FUNCTION %s', f);
	ELSE
		EXECUTE pg_catalog.format('ALTER FUNCTION %s RENAME TO %I', f,
			'_parked_' OPERATOR(pg_catalog.||) p.proname);
	END IF;
END;
$$;

/*
 * Give each API function the owner and privileges of the older version's
 * that _update_set_aside parked, and drop that one.  The privileges are
 * granted again in the order the old ACL lists them, each by its grantor
 * where the role running the script may act as that role, else by the
 * owner (the grantee keeps its privilege; only the grantor recorded
 * differs).  A function whose ACL was the default keeps the default.
 */
CREATE OR REPLACE FUNCTION idempotency._update_take_over()
RETURNS void
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
	my_role text := pg_catalog.current_setting('role');
	old record;
	fn regprocedure;
	owner name;
	item record;
	stmt text;
BEGIN
	FOR old IN
		SELECT p.oid::regprocedure AS fn, pg_catalog.substr(p.proname::text, 9) AS name,
			   pg_catalog.pg_get_userbyid(p.proowner) AS owner, p.proacl AS acl
		  FROM pg_catalog.pg_proc p
		 WHERE p.pronamespace OPERATOR(pg_catalog.=) 'idempotency'::regnamespace
		   AND pg_catalog.starts_with(p.proname::text, '_parked_')
	LOOP
		-- every API function has one signature
		SELECT p.oid::regprocedure, pg_catalog.pg_get_userbyid(p.proowner) INTO fn, owner
		  FROM pg_catalog.pg_proc p
		 WHERE p.pronamespace OPERATOR(pg_catalog.=) 'idempotency'::regnamespace
		   AND p.proname OPERATOR(pg_catalog.=) old.name;
		IF owner OPERATOR(pg_catalog.<>) old.owner THEN
			EXECUTE pg_catalog.format('ALTER FUNCTION %s OWNER TO %I', fn, old.owner);
		END IF;
		IF old.acl IS NOT NULL THEN
			EXECUTE pg_catalog.format('REVOKE ALL ON FUNCTION %s FROM PUBLIC, %I', fn, old.owner);
			FOR item IN
				SELECT pg_catalog.pg_get_userbyid(a.grantor) AS grantor,
					   CASE WHEN a.grantee OPERATOR(pg_catalog.=) 0 THEN 'PUBLIC'
							ELSE pg_catalog.quote_ident(pg_catalog.pg_get_userbyid(a.grantee)) END AS grantee,
					   a.is_grantable
				  FROM pg_catalog.aclexplode(old.acl) WITH ORDINALITY a
				 ORDER BY a.ordinality
			LOOP
				stmt := pg_catalog.format('GRANT EXECUTE ON FUNCTION %s TO %s%s', fn, item.grantee,
					CASE WHEN item.is_grantable THEN ' WITH GRANT OPTION' ELSE '' END);
				IF item.grantor OPERATOR(pg_catalog.=) old.owner THEN
					EXECUTE stmt;
				ELSE
					BEGIN
						PERFORM pg_catalog.set_config('role', item.grantor, true);
						EXECUTE stmt;
						PERFORM pg_catalog.set_config('role', my_role, true);
					EXCEPTION WHEN insufficient_privilege THEN
						EXECUTE stmt;
					END;
				END IF;
			END LOOP;
		END IF;
		EXECUTE pg_catalog.format('DROP FUNCTION %s', old.fn);
	END LOOP;
END;
$$;

/* ---------------------------------------------------------------------
 * Helpers: settings, argument checks (args.c, guc.c)
 * ---------------------------------------------------------------------
 */

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

-- versions up to 1.6.4 had _guc_bytes without "unlimited": an update drops
-- it first, so that no call here can match both
DO $do$
BEGIN
	IF pg_catalog.to_regprocedure('idempotency._guc_bytes(text, bigint, boolean)') IS NOT NULL THEN
		DROP FUNCTION idempotency._guc_bytes(text, bigint, boolean);
	END IF;
END;
$do$;

/*
 * An idempotency.* setting that counts bytes (or plain numbers).  The C
 * edition lets only superusers change max_response_size and
 * stats_exact_limit (superuser_only); a placeholder can be set by anyone,
 * with SET, a startup option or ALTER ROLE on itself.  So for a session
 * whose login role is no superuser a value counts only up to the trusted
 * one: what ALTER DATABASE ... SET (the database owner) or ALTER ROLE ALL
 * SET gave this database, else the default.  A session may lower the
 * limit for itself, never raise it.  -1 is "no limit" where the setting
 * allows it ("unlimited"), the largest value there is.
 */
CREATE OR REPLACE FUNCTION idempotency._guc_bytes(name text, dflt bigint,
	superuser_only boolean DEFAULT false, unlimited boolean DEFAULT false)
RETURNS bigint
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
	v bigint := idempotency._parse_bytes(name,
		pg_catalog.current_setting(name, true), dflt, unlimited);
	trusted bigint := dflt;
	t text;
BEGIN
	-- any session may lower the limit for itself: only a higher value is
	-- checked against the trusted one
	IF NOT superuser_only OR (v OPERATOR(pg_catalog.>=) 0 AND v OPERATOR(pg_catalog.<=) dflt)
	   OR (SELECT r.rolsuper FROM pg_catalog.pg_roles r
		   WHERE r.rolname OPERATOR(pg_catalog.=) session_user) THEN
		RETURN v;
	END IF;
	SELECT pg_catalog.substr(c, pg_catalog.strpos(c, '=') OPERATOR(pg_catalog.+) 1) INTO t
	  FROM pg_catalog.pg_db_role_setting s, pg_catalog.unnest(s.setconfig) c
	 WHERE s.setrole OPERATOR(pg_catalog.=) 0
	   AND s.setdatabase OPERATOR(pg_catalog.=) ANY (ARRAY[0::oid,
			(SELECT d.oid FROM pg_catalog.pg_database d
			  WHERE d.datname OPERATOR(pg_catalog.=) pg_catalog.current_database())])
	   AND pg_catalog.starts_with(c, name OPERATOR(pg_catalog.||) '=')
	 ORDER BY s.setdatabase DESC
	 LIMIT 1;
	IF FOUND THEN
		trusted := idempotency._parse_bytes(name, t, dflt, unlimited);
	END IF;
	IF unlimited AND v OPERATOR(pg_catalog.<) 0 THEN
		RETURN trusted;			-- "no limit" is the largest value
	END IF;
	IF unlimited AND trusted OPERATOR(pg_catalog.<) 0 THEN
		RETURN v;
	END IF;
	RETURN LEAST(v, trusted);
END;
$$;

/* A byte count as the settings take it: a number with an optional unit. */
CREATE OR REPLACE FUNCTION idempotency._parse_bytes(name text, v text, dflt bigint,
	unlimited boolean)
RETURNS bigint
LANGUAGE plpgsql IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
	m text[];
BEGIN
	v := pg_catalog.btrim(v);
	IF v IS NULL OR v OPERATOR(pg_catalog.=) '' THEN
		RETURN dflt;
	END IF;
	IF unlimited AND v OPERATOR(pg_catalog.=) '-1' THEN
		RETURN -1;
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

/*
 * idempotency.max_response_size in bytes: the default unless set (or set
 * to the default as the C library shows it), so that the usual case reads
 * one setting (an inlined SQL function).
 */
CREATE OR REPLACE FUNCTION idempotency._response_limit()
RETURNS bigint
LANGUAGE sql STABLE
RETURN CASE WHEN COALESCE(pg_catalog.current_setting('idempotency.max_response_size', true), '1MB')
			OPERATOR(pg_catalog.=) ANY (ARRAY['', '1MB', '1048576']) THEN 1048576
	ELSE idempotency._guc_bytes('idempotency.max_response_size', 1048576, true) END;

/*
 * idempotency.lease and idempotency.retention as intervals: the default
 * unless set (or set to the default as the C library shows it), so that
 * the usual case reads one setting (inlined SQL functions).
 */
CREATE OR REPLACE FUNCTION idempotency._lease_setting()
RETURNS interval
LANGUAGE sql STABLE
RETURN CASE WHEN COALESCE(pg_catalog.current_setting('idempotency.lease', true), '')
			OPERATOR(pg_catalog.=) ANY (ARRAY['', '30s']) THEN '00:00:30'::interval
	ELSE idempotency._guc_interval('idempotency.lease', 'ms', '00:00:30') END;

CREATE OR REPLACE FUNCTION idempotency._retention_setting()
RETURNS interval
LANGUAGE sql STABLE
RETURN CASE WHEN COALESCE(pg_catalog.current_setting('idempotency.retention', true), '')
			OPERATOR(pg_catalog.=) ANY (ARRAY['', '1d']) THEN '24:00:00'::interval
	ELSE idempotency._guc_interval('idempotency.retention', 's', '24:00:00') END;

/*
 * idempotency.remember when it is set: what _guc_interval reads, refused
 * (22023) where the C edition refuses the setting (below 0, above
 * 2147483647 seconds), NULL for 0.
 */
CREATE OR REPLACE FUNCTION idempotency._remember_guc()
RETURNS interval
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
	iv interval := idempotency._guc_interval('idempotency.remember', 's', '0');
BEGIN
	IF iv OPERATOR(pg_catalog.<) '0'::interval OR
	   iv OPERATOR(pg_catalog.>) pg_catalog.make_interval(secs => 2147483647) THEN
		RAISE EXCEPTION '% is outside the valid range for parameter "idempotency.remember" (0 .. 2147483647)',
			pg_catalog.current_setting('idempotency.remember')
			USING ERRCODE = '22023';
	END IF;
	RETURN NULLIF(iv, '0'::interval);
END;
$$;

/*
 * idempotency.remember as the interval a claim stores: NULL (not
 * remembered) unless set to more than 0, so that the usual case reads one
 * setting (an inlined SQL function).  A bare number counts seconds.
 */
CREATE OR REPLACE FUNCTION idempotency._remember_setting()
RETURNS interval
LANGUAGE sql STABLE
RETURN CASE WHEN COALESCE(pg_catalog.current_setting('idempotency.remember', true), '')
			OPERATOR(pg_catalog.=) ANY (ARRAY['', '0']) THEN NULL
	ELSE idempotency._remember_guc() END;

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
 * A lease, retention or remember: NULL (the setting applies), positive (or
 * with "allow_zero" zero, which turns remembering off), and at most 10000
 * years (interval comparison counts months as 30 days, as the C edition
 * does).
 */
CREATE OR REPLACE FUNCTION idempotency._check_interval(iv interval, name text, allow_zero boolean)
RETURNS void
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
	now timestamptz;
	bad text := CASE WHEN allow_zero THEN '%s must not be negative' ELSE '%s must be positive' END;
BEGIN
	IF iv IS NULL THEN
		RETURN;
	END IF;
	IF iv OPERATOR(pg_catalog.<) '0'::interval OR
	   (iv OPERATOR(pg_catalog.=) '0'::interval AND NOT allow_zero) THEN
		RAISE EXCEPTION USING ERRCODE = '22023', MESSAGE = pg_catalog.format(bad, name);
	END IF;
	IF iv OPERATOR(pg_catalog.>) '10000 years'::interval THEN
		RAISE EXCEPTION '% is too large', name
			USING ERRCODE = '22023', DETAIL = 'The limit is 10000 years.';
	END IF;
	now := pg_catalog.clock_timestamp();
	IF iv OPERATOR(pg_catalog.>) '0'::interval AND now OPERATOR(pg_catalog.+) iv OPERATOR(pg_catalog.<=) now THEN
		RAISE EXCEPTION USING ERRCODE = '22023', MESSAGE = pg_catalog.format(bad, name);
	END IF;
END;
$$;

/* A lease or retention: NULL (the setting applies) or positive. */
CREATE OR REPLACE FUNCTION idempotency._check_positive(iv interval, name text)
RETURNS void
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
	PERFORM idempotency._check_interval(iv, name, false);
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
	lim := idempotency._response_limit();
	bytes := pg_catalog.pg_column_size(body::text::jsonb) OPERATOR(pg_catalog.-) 4;
	IF bytes OPERATOR(pg_catalog.>) lim THEN
		RAISE EXCEPTION '% is too large', name
			USING ERRCODE = '54000',
				  DETAIL = pg_catalog.format('It has %s bytes; idempotency.max_response_size is %s bytes.', bytes, lim);
	END IF;
END;
$$;

/*
 * Is the request a claim asks to keep larger than a response body may be?
 * The one test idem_claim's first condition makes of it, as a call: a
 * PL/pgSQL function, not an inlined SQL one, because PL/pgSQL builds that
 * condition's expression anew in every transaction, and _response_limit
 * inlined there cost every claim, keep_request or not, about a
 * microsecond.  No SET clause: it runs only inside idem_claim, which pins
 * search_path.
 */
CREATE OR REPLACE FUNCTION idempotency._request_too_large(request jsonb)
RETURNS boolean
LANGUAGE plpgsql STABLE
AS $$
BEGIN
	RETURN request IS NOT NULL AND
		pg_catalog.pg_column_size(request::text::jsonb) OPERATOR(pg_catalog.-) 4
			OPERATOR(pg_catalog.>) idempotency._response_limit();
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
 * or types, a lost NOT NULL, or an index on other columns.  Run by
 * _store_verdict when a plan of the API functions is made, and by
 * _check_store to name what is missing.
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
		'phase', 'phase_data', 'owner_session', 'remember', 'request'];
	types oid[] := ARRAY['text'::regtype, 'text'::regtype, 'text'::regtype,
		'bigint'::regtype, 'integer'::regtype, 'bytea'::regtype,
		'integer'::regtype, 'jsonb'::regtype, 'timestamptz'::regtype,
		'timestamptz'::regtype, 'timestamptz'::regtype, 'timestamptz'::regtype,
		'interval'::regtype, 'timestamptz'::regtype, 'text'::regtype,
		'jsonb'::regtype, 'bigint'::regtype, 'interval'::regtype,
		'jsonb'::regtype]::oid[];
	required boolean[] := ARRAY[true, true, true, false, true, false, false,
		false, true, false, false, true, true, true, false, false, false, false, false];
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
	IF pg_catalog.to_regclass('idempotency.key_lanes') IS NULL THEN
		RAISE EXCEPTION 'table "idempotency.key_lanes" of extension "idempotency" is missing'
			USING ERRCODE = '55000', HINT = 'Someone dropped the extension''s objects; reinstall the extension.';
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
	IF natts OPERATOR(pg_catalog.<>) 19 THEN
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
			('keys_owner_session_idx', '17', true), ('keys_abandoned_idx', '1 9', true)) n(name, cols, partial)
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

/*
 * The verdict on the store, for the API functions' first query: raises
 * what _check_catalog and _check_bindings raise, and 55000 for an index
 * whose expressions or predicate call a LANGUAGE sql function PostgreSQL
 * may inline (its body would be parsed with the search_path of whichever
 * session plans the table first); else returns
 *   1  when a write runs code a user attached to idempotency.keys: a
 *      trigger (a foreign key that references the table has them), a rule,
 *      row security, a stored generated column, any CHECK constraint, any
 *      index expression or predicate but those of keys_owner_session_idx
 *      and keys_abandoned_idx, an access method, operator class or
 *      exclusion operator that is not PostgreSQL's own;
 *   2  added when one of those triggers is deferrable (it fires at commit,
 *      outside the call);
 *   4  added when the table has a rule on INSERT or UPDATE, where
 *      PostgreSQL refuses INSERT ... ON CONFLICT (a claim inserts without);
 * else 0.  IMMUTABLE although it reads the catalog, so that the planner
 * folds it into the plan: the plan is the cache, and every change that
 * alters the answer also invalidates the plans that read the table.
 */
CREATE OR REPLACE FUNCTION idempotency._store_verdict()
RETURNS integer
LANGUAGE plpgsql IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
	RETURN idempotency._store_verdict_read();
END;
$$;

/*
 * The store's verdict for a write.  The keys table is locked ROW EXCLUSIVE
 * first: a lock this transaction did not hold yet makes it take in the DDL
 * committed meanwhile (the plan below is made again), and while it is held
 * no trigger, rule or policy can be attached.  A read alone takes no such
 * lock, so that a replay never waits for a CREATE INDEX.  No SET clause: it
 * runs only inside the API functions, which pin search_path.
 */
CREATE OR REPLACE FUNCTION idempotency._write_verdict()
RETURNS integer
LANGUAGE plpgsql VOLATILE
AS $$
BEGIN
	LOCK TABLE idempotency.keys IN ROW EXCLUSIVE MODE;
	RETURN (SELECT v.verdict
			  FROM (SELECT idempotency._store_verdict() AS verdict,
						   'idempotency.token_seq'::pg_catalog.regclass AS seq) v
			  LEFT JOIN idempotency.keys k ON false);
END;
$$;

/*
 * What _store_verdict answers, read from the catalog.  VOLATILE, so that
 * each of its queries (and those of the checks it calls) reads the
 * catalog as committed now: the planner calls it while it plans, after
 * it waited for the locks of a DDL that just committed, with the
 * snapshot of the statement taken before that wait.
 */
CREATE OR REPLACE FUNCTION idempotency._store_verdict_read()
RETURNS integer
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
	keys oid;
	session_idx oid;
	abandoned_idx oid;
	f record;
	flags integer := 0;
BEGIN
	PERFORM idempotency._check_catalog();
	PERFORM idempotency._check_bindings();
	keys := pg_catalog.to_regclass('idempotency.keys');
	session_idx := pg_catalog.to_regclass('idempotency.keys_owner_session_idx');
	abandoned_idx := pg_catalog.to_regclass('idempotency.keys_abandoned_idx');
	SELECT ic.relname, pg_catalog.quote_ident(p.proname) OPERATOR(pg_catalog.||) '('
		   OPERATOR(pg_catalog.||) pg_catalog.pg_get_function_identity_arguments(p.oid)
		   OPERATOR(pg_catalog.||) ')' AS fn INTO f
	  FROM pg_catalog.pg_index i
	  JOIN pg_catalog.pg_class ic ON ic.oid OPERATOR(pg_catalog.=) i.indexrelid
	  JOIN pg_catalog.pg_depend d
		ON d.classid OPERATOR(pg_catalog.=) 'pg_catalog.pg_class'::pg_catalog.regclass
	   AND d.objid OPERATOR(pg_catalog.=) i.indexrelid
	   AND d.refclassid OPERATOR(pg_catalog.=) 'pg_catalog.pg_proc'::pg_catalog.regclass
	  JOIN pg_catalog.pg_proc p ON p.oid OPERATOR(pg_catalog.=) d.refobjid
	 WHERE i.indrelid OPERATOR(pg_catalog.=) keys
	   AND p.prolang OPERATOR(pg_catalog.=) (SELECT l.oid FROM pg_catalog.pg_language l
											 WHERE l.lanname OPERATOR(pg_catalog.=) 'sql')
	   AND NOT p.prosecdef AND p.proconfig IS NULL AND p.prosqlbody IS NULL
	 LIMIT 1;
	IF FOUND THEN
		RAISE EXCEPTION 'index "%" of idempotency.keys calls SQL function %, whose body PostgreSQL inlines with the search_path of the session that plans it',
			f.relname, f.fn
			USING ERRCODE = '55000',
				  HINT = 'Give the function a search_path (ALTER FUNCTION ... SET search_path = pg_catalog) or a BEGIN ATOMIC body, or drop the index.';
	END IF;
	IF EXISTS (SELECT FROM pg_catalog.pg_trigger t WHERE t.tgrelid OPERATOR(pg_catalog.=) keys)
	   OR EXISTS (SELECT FROM pg_catalog.pg_rewrite r WHERE r.ev_class OPERATOR(pg_catalog.=) keys)
	   OR EXISTS (SELECT FROM pg_catalog.pg_class c
				   WHERE c.oid OPERATOR(pg_catalog.=) keys
					 AND (c.relrowsecurity OR c.relam OPERATOR(pg_catalog.>=) 16384))
	   OR EXISTS (SELECT FROM pg_catalog.pg_attribute a
				   WHERE a.attrelid OPERATOR(pg_catalog.=) keys AND a.attnum OPERATOR(pg_catalog.>) 0
					 AND NOT a.attisdropped AND a.attgenerated OPERATOR(pg_catalog.<>) '')
	   OR EXISTS (SELECT FROM pg_catalog.pg_constraint k
				   WHERE k.conrelid OPERATOR(pg_catalog.=) keys
					 AND (k.contype OPERATOR(pg_catalog.=) 'c'
						  OR (k.contype OPERATOR(pg_catalog.=) 'x' AND EXISTS (
							  SELECT FROM pg_catalog.pg_operator op
							   WHERE op.oid OPERATOR(pg_catalog.=) ANY (k.conexclop)
								 AND op.oprcode::pg_catalog.oid OPERATOR(pg_catalog.>=) 16384))))
	   OR EXISTS (SELECT FROM pg_catalog.pg_index i
				  WHERE i.indrelid OPERATOR(pg_catalog.=) keys
					AND (i.indexprs IS NOT NULL
						 OR (i.indpred IS NOT NULL AND i.indexrelid IS DISTINCT FROM session_idx
							 AND i.indexrelid IS DISTINCT FROM abandoned_idx)
						 OR EXISTS (SELECT FROM pg_catalog.pg_class ic
									 WHERE ic.oid OPERATOR(pg_catalog.=) i.indexrelid
									   AND ic.relam OPERATOR(pg_catalog.>=) 16384)
						 OR EXISTS (SELECT FROM pg_catalog.pg_opclass o
									 WHERE o.oid OPERATOR(pg_catalog.=) ANY (i.indclass::pg_catalog.oid[])
									   AND (o.oid OPERATOR(pg_catalog.>=) 16384 OR EXISTS (
										   SELECT FROM pg_catalog.pg_amproc ap
											WHERE ap.amprocfamily OPERATOR(pg_catalog.=) o.opcfamily
											  AND ap.amproc::pg_catalog.oid OPERATOR(pg_catalog.>=) 16384))))) THEN
		flags := 1;
	END IF;
	IF EXISTS (SELECT FROM pg_catalog.pg_trigger t
				WHERE t.tgrelid OPERATOR(pg_catalog.=) keys AND t.tgdeferrable
				  AND t.tgfoid OPERATOR(pg_catalog.>=) 16384) THEN
		flags := flags OPERATOR(pg_catalog.|) 2;
	END IF;
	IF EXISTS (SELECT FROM pg_catalog.pg_rewrite r
				WHERE r.ev_class OPERATOR(pg_catalog.=) keys
				  AND r.ev_type OPERATOR(pg_catalog.=) ANY (ARRAY['2', '3']::"char"[])) THEN
		flags := flags OPERATOR(pg_catalog.|) 4;
	END IF;
	RETURN flags;
END;
$$;

/*
 * Before a write under the verdict "flags": refuse (55000) while the table
 * has a deferrable trigger of a user's, and, while it runs a user's code,
 * in a session that has temporary tables or types.  Such code runs with
 * the owner's rights, and PostgreSQL looks table and type names up in the
 * session's temporary schema whatever search_path says: a caller's
 * temporary table named like an unqualified table in a trigger would
 * receive the owner's write.
 */
CREATE OR REPLACE FUNCTION idempotency._refuse_write(flags integer)
RETURNS void
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
	IF flags OPERATOR(pg_catalog.&) 2 OPERATOR(pg_catalog.<>) 0 THEN
		RAISE EXCEPTION 'cannot write idempotency keys while idempotency.keys has a deferrable trigger'
			USING ERRCODE = '55000',
				  DETAIL = 'A deferred trigger fires at commit, outside the write, where it cannot run with the restrictions the table owner''s rights need.',
				  HINT = 'Make the trigger NOT DEFERRABLE, or drop it.';
	END IF;
	IF flags OPERATOR(pg_catalog.&) 5 OPERATOR(pg_catalog.<>) 0
	   AND pg_catalog.pg_my_temp_schema() OPERATOR(pg_catalog.<>) 0
	   AND EXISTS (SELECT FROM pg_catalog.pg_depend d
					WHERE d.refclassid OPERATOR(pg_catalog.=) 'pg_catalog.pg_namespace'::pg_catalog.regclass
					  AND d.refobjid OPERATOR(pg_catalog.=) pg_catalog.pg_my_temp_schema()
					  AND d.classid OPERATOR(pg_catalog.=) ANY (ARRAY['pg_catalog.pg_class'::pg_catalog.regclass,
						  'pg_catalog.pg_type'::pg_catalog.regclass]::pg_catalog.oid[])) THEN
		RAISE EXCEPTION 'cannot write idempotency keys while this session has temporary objects'
			USING ERRCODE = '55000',
				  DETAIL = 'idempotency.keys has triggers, rules, row security, constraints or index expressions, which run with its owner''s rights, and PostgreSQL looks table and type names up in the session''s temporary schema whatever search_path says.',
				  HINT = 'Drop this session''s temporary tables and types (DISCARD TEMP), or call the function from a session without them.';
	END IF;
END;
$$;

/*
 * Raise what is wrong when the tables the API functions read are not
 * there under their names: those functions name them in their first
 * query, which PostgreSQL would refuse with a bare 42P01 before the
 * verdict could say more.
 */
CREATE OR REPLACE FUNCTION idempotency._check_store()
RETURNS void
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
	PERFORM idempotency._check_catalog();
	PERFORM idempotency._check_bindings();
END;
$$;

/*
 * The settings a write's attached code could change, before the write:
 * every setting a role may change for its session (context user or
 * superuser), as pg_settings shows it.  Taken only where the store's
 * verdict says a write runs a user's code.
 */
CREATE OR REPLACE FUNCTION idempotency._settings_save()
RETURNS jsonb
LANGUAGE sql VOLATILE
SET search_path = pg_catalog, pg_temp
BEGIN ATOMIC
	SELECT pg_catalog.jsonb_object_agg(s.name, s.setting)
	  FROM pg_catalog.pg_settings s
	 WHERE s.context OPERATOR(pg_catalog.=) ANY (ARRAY['user', 'superuser']);
END;

/*
 * After a write that ran a user's code: set back every setting that code
 * changed ("saved" from _settings_save), so that a trigger's SET or
 * set_config(..., false) ends with the write, as in the C edition's
 * restricted sections, and pin search_path again for the rest of the
 * call (a later row's trigger must not run with a path an earlier one
 * set).  search_path is set for the calling function only (its SET
 * clause restores the caller's at exit); any other setting for the
 * session, as the caller had it.
 */
CREATE OR REPLACE FUNCTION idempotency._settings_restore(saved jsonb)
RETURNS void
LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
	c record;
BEGIN
	FOR c IN
		SELECT s.name, saved OPERATOR(pg_catalog.->>) s.name AS old
		  FROM pg_catalog.pg_settings s
		 WHERE s.context OPERATOR(pg_catalog.=) ANY (ARRAY['user', 'superuser'])
		   AND s.name OPERATOR(pg_catalog.<>) 'search_path'
		   AND s.setting IS DISTINCT FROM saved OPERATOR(pg_catalog.->>) s.name
	LOOP
		IF c.old IS NOT NULL THEN
			PERFORM pg_catalog.set_config(c.name, c.old, false);
		END IF;
	END LOOP;
	PERFORM pg_catalog.set_config('search_path', 'pg_catalog, pg_temp', true);
END;
$$;

/*
 * The role a call acts for: the role the session became with SET ROLE,
 * else the role it logged in as (or was given by SET SESSION
 * AUTHORIZATION).  Inside a SECURITY DEFINER function current_user is the
 * function's owner; these two are what the session itself is, and no call
 * can change them: SET ROLE accepts only a role the session's login role
 * may become (from PostgreSQL 16 on, a membership granted WITH SET TRUE),
 * and PostgreSQL refuses SET ROLE inside a SECURITY DEFINER function.  So
 * where the C edition checks current_user, this edition checks the
 * session's role: the same role, unless the call comes through another
 * SECURITY DEFINER function, whose owner the C edition would check (the
 * session's role is held to its binding either way).  An inlined SQL
 * function: it costs a call nothing.
 */
CREATE OR REPLACE FUNCTION idempotency._caller()
RETURNS name
LANGUAGE sql STABLE
RETURN CASE WHEN pg_catalog.current_setting('role') OPERATOR(pg_catalog.=) 'none'
	THEN session_user ELSE pg_catalog.current_setting('role')::name END;

/*
 * Raise the error of a binding that refuses "scope" to "who" (42501), or
 * of a binding row without a prefix (XX001: the table lost its NOT NULL).
 * Called only to raise, after the check made inline found the scope
 * refused.
 */
CREATE OR REPLACE FUNCTION idempotency._tenant_refuse(who name, scope text, prefix text)
RETURNS void
LANGUAGE plpgsql IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
	IF prefix IS NULL THEN
		RAISE EXCEPTION 'table "idempotency.scope_bindings" has a row with a NULL role or prefix'
			USING ERRCODE = 'XX001', HINT = 'Someone changed the table''s constraints; delete that row.';
	END IF;
	RAISE EXCEPTION 'permission denied for idempotency scope "%"', scope
		USING ERRCODE = '42501',
			  DETAIL = pg_catalog.format('Role "%s" may only use scopes that start with "%s".', who, prefix);
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
 * Is a key remembered at "now": finished, past its retention and not past
 * its remember?  Such a key never runs again: a claim answers expired (or
 * mismatch), whether or not a sweep has compacted it yet.  False, never
 * NULL, for a key without remember.  An inlined SQL function.
 */
CREATE OR REPLACE FUNCTION idempotency._remembered(status text, expires_at timestamptz,
	remember interval, now timestamptz)
RETURNS boolean
LANGUAGE sql STABLE
RETURN remember IS NOT NULL AND status OPERATOR(pg_catalog.<>) 'pending'
	AND expires_at OPERATOR(pg_catalog.<=) now
	AND expires_at OPERATOR(pg_catalog.+) remember OPERATOR(pg_catalog.>) now;

/*
 * Is the row version whose xmax is "x" changed or row-locked right now by
 * another transaction through a multixact?  A row that several
 * transactions lock, or that one transaction locks and then updates in a
 * subtransaction (a fresh claim inserts inside an exception block), carries
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

-- versions before 1.7.0 returned no remember (01_update.sql)
DO $do$
BEGIN
	PERFORM idempotency._update_set_aside('idempotency._probe(text,text)', 'remember');
END;
$do$;

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
 * may write inside an exception block) or through a multixact, committed
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
	OUT phase_data jsonb, OUT owner_session bigint, OUT remember interval)
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
		owner_session := rec.owner_session; remember := rec.remember;
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
 * Claims (claim.c, write.c, wait.c)
 * ---------------------------------------------------------------------
 */

/*
 * The lane of (scope, key) in key_lanes: the scope's byte length first,
 * so that ("ab", "c") and ("a", "bc") differ.  An inlined SQL function:
 * the claim that locks a lane and the waiter that waits on it compute the
 * same number.
 */
CREATE OR REPLACE FUNCTION idempotency._key_lane(scope text, key text)
RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE
RETURN pg_catalog.hashtext(pg_catalog.octet_length(scope)::text OPERATOR(pg_catalog.||) ':'
	OPERATOR(pg_catalog.||) scope OPERATOR(pg_catalog.||) key) OPERATOR(pg_catalog.&) 262143;

-- versions before 1.7.0 had no p_remember, before 1.8.0 no p_request
-- (01_update.sql)
DO $do$
BEGIN
	PERFORM idempotency._update_set_aside(
		'idempotency._claim_key(name,oid,text,bytea,text,interval,interval,boolean)');
	PERFORM idempotency._update_set_aside(
		'idempotency._claim_key(name,oid,text,bytea,text,interval,interval,boolean,interval)');
END;
$do$;

/*
 * One claim of (p_scope, p_key) for the role p_who (its oid p_role), the
 * arguments checked: answered from one read of the key, its binding and
 * the store's verdict when that read can answer (a replay, a mismatch, a
 * remembered key's expired, a live claim of another attempt: no lock, no
 * subtransaction), written otherwise:
 *   - a new key: its lane locked without waiting (key_lanes: a lane another
 *     transaction holds answers in_progress), then one INSERT ... ON
 *     CONFLICT DO NOTHING, which cannot wait, as no other claim inserts
 *     the key (a conflict is a claim that committed since the read);
 *   - a key whose attempt ended (lease over, session gone) or whose
 *     retention passed: the row locked without waiting (FOR NO KEY UPDATE
 *     SKIP LOCKED, which also reads its newest committed version), judged
 *     again and updated; a claim that writes stores p_remember (NULL: not
 *     remembered) and p_request, the request kept for a completer: a fresh
 *     claim stores it as it is (NULL: none), a takeover only when it is
 *     not NULL, and keeps the stored one otherwise (with keep_request and
 *     no request both are NULL, as the fingerprints match).
 * A row version another transaction is changing or locking right now
 * answers in_progress (_probe tells).  Besides the claim's columns it says
 * why a key is in progress ("busy": 'row' when another transaction holds
 * the row, 'lane' when it holds the key's lane, NULL for a claim that
 * committed), whether this transaction holds the claim itself ("held"),
 * until when the lease runs, and the WAL position the token needs flushed
 * before it leaves ("token_lsn").  It has no SET clause of its own (each
 * costs every call a settings change): it runs only inside idem_claim and
 * idem_claim_many, which pin search_path and the plan cache mode, and
 * names every object with its schema like every function here.
 */
CREATE OR REPLACE FUNCTION idempotency._claim_key(p_who name, p_role oid,
	p_key text, p_fp bytea, p_scope text, p_lease interval,
	p_retention interval, p_session_bound boolean, p_remember interval,
	p_request jsonb, OUT outcome text, OUT token bigint, OUT attempt integer, OUT status text,
	OUT response_code integer, OUT response_body jsonb, OUT retry_after integer,
	OUT phase text, OUT phase_data jsonb,
	OUT busy text, OUT held boolean, OUT lease_until timestamptz,
	OUT token_lsn pg_lsn)
LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
	r record;
	p record;
	l record;
	now timestamptz;
	first text;
	action text;
	lease interval;
	ret interval;
	expires timestamptz;
	owner bigint;
	saved jsonb;
	n bigint;
	round integer := 0;
BEGIN
	held := false;
	IF pg_catalog.to_regclass('idempotency.keys') IS NULL OR
	   pg_catalog.to_regclass('idempotency.scope_bindings') IS NULL THEN
		PERFORM idempotency._check_store();
	END IF;
	LOOP
		round := round OPERATOR(pg_catalog.+) 1;
		EXIT WHEN round OPERATOR(pg_catalog.>) 3;
		SELECT v.verdict, b.role IS NOT NULL AS bound, b.scope_prefix AS prefix,
			   k.ctid IS NOT NULL AS present, false AS busy, false AS mine,
			   k.ctid AS tid, k.xmax AS xmax_, k.status, k.token, k.attempt,
			   k.fingerprint, k.response_code, k.response_body, k.created_at,
			   k.lease_until, k.expires_at, k.retention, k.sweep_at, k.phase,
			   k.phase_data, k.owner_session, k.remember
		  INTO r
		  FROM (SELECT idempotency._store_verdict() AS verdict,
					   'idempotency.token_seq'::pg_catalog.regclass AS seq) v
		  LEFT JOIN idempotency.scope_bindings b
			ON b.role::pg_catalog.oid OPERATOR(pg_catalog.=) p_role
		  LEFT JOIN idempotency.keys k
			ON k.scope OPERATOR(pg_catalog.=) p_scope AND k.key OPERATOR(pg_catalog.=) p_key;
		IF r.bound AND (r.prefix IS NULL OR NOT pg_catalog.starts_with(p_scope, r.prefix)) THEN
			PERFORM idempotency._tenant_refuse(p_who, p_scope, r.prefix);
		END IF;
		now := pg_catalog.clock_timestamp();
		p := r;
		IF r.present THEN
			IF r.status IS NULL OR r.attempt IS NULL OR r.created_at IS NULL OR
			   r.expires_at IS NULL OR r.retention IS NULL OR r.sweep_at IS NULL OR
			   r.status OPERATOR(pg_catalog.<>) ALL (ARRAY['pending', 'succeeded', 'failed']) OR
			   pg_catalog.octet_length(r.fingerprint) OPERATOR(pg_catalog.<>) 32 THEN
				PERFORM idempotency._check_row(p_scope, p_key, r.status, r.attempt,
					r.created_at, r.expires_at, r.retention, r.sweep_at, r.fingerprint);
			END IF;
			first := pg_catalog.current_setting('idempotency_sql.xact_first_token', true);
			-- A version that was locked or replaced, or a claim this
			-- transaction may have made itself: ask who holds it.
			IF r.xmax_ OPERATOR(pg_catalog.<>) '0'::xid OR
			   (r.status OPERATOR(pg_catalog.=) 'pending' AND first OPERATOR(pg_catalog.<>) '' AND
				r.token OPERATOR(pg_catalog.>=) first::bigint) THEN
				SELECT * INTO p FROM idempotency._probe(p_scope, p_key);
			END IF;
		END IF;

		-- claim_decide
		outcome := NULL; token := NULL; attempt := NULL; status := NULL;
		response_code := NULL; response_body := NULL; retry_after := NULL;
		phase := NULL; phase_data := NULL; lease_until := NULL; busy := NULL;
		IF p.busy THEN
			outcome := 'in_progress'; retry_after := 1; busy := 'row';
			RETURN;
		ELSIF NOT p.present OR (p.expires_at OPERATOR(pg_catalog.<=) now AND
			  NOT idempotency._remembered(p.status, p.expires_at, p.remember, now)) THEN
			action := 'fresh';
		ELSIF p.fingerprint IS DISTINCT FROM p_fp THEN
			outcome := 'mismatch';
			RETURN;
		ELSIF p.expires_at OPERATOR(pg_catalog.<=) now THEN
			-- remembered: it ran, and its response is gone; it never runs again
			outcome := 'expired'; status := p.status; response_code := p.response_code;
			RETURN;
		ELSIF p.status OPERATOR(pg_catalog.<>) 'pending' THEN
			outcome := 'replay'; status := p.status;
			response_code := p.response_code; response_body := p.response_body;
			RETURN;
		ELSIF p.token IS NOT NULL AND
			  ((p.mine AND first OPERATOR(pg_catalog.<>) '' AND p.token OPERATOR(pg_catalog.>=) first::bigint) OR
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

		-- a write: the verdict again, under the table's write lock
		r.verdict := idempotency._write_verdict();
		IF r.verdict OPERATOR(pg_catalog.<>) 0 THEN
			PERFORM idempotency._refuse_write(r.verdict);
			saved := idempotency._settings_save();
		END IF;
		owner := CASE WHEN p_session_bound THEN idempotency._session_binding() END;
		IF p_session_bound AND owner IS NULL THEN
			-- the functions' owner cannot see this backend's start: a binding
			-- that no one could check later would bind nothing
			RAISE EXCEPTION 'cannot bind a claim to this session'
				USING ERRCODE = '42501',
					  DETAIL = pg_catalog.format('Role "%s", which owns the idempotency functions, cannot read this session''s row of pg_stat_activity.', current_user),
					  HINT = 'GRANT pg_read_all_stats TO that role, or claim without session_bound.';
		END IF;
		lease := COALESCE(p_lease, idempotency._lease_setting());
		ret := COALESCE(p_retention, idempotency._retention_setting());
		lease_until := now OPERATOR(pg_catalog.+) lease;
		expires := GREATEST(now OPERATOR(pg_catalog.+) ret, lease_until);

		IF NOT p.present THEN
			-- The token first, and the WAL position just after it: the
			-- lane's lock writes WAL too, which the token need not wait for.
			token := pg_catalog.nextval('idempotency.token_seq'::pg_catalog.regclass);
			token_lsn := pg_catalog.pg_current_wal_insert_lsn();
			-- Another transaction inserting a key of this lane holds its
			-- lock (see key_lanes): in_progress, without waiting.
			PERFORM FROM idempotency.key_lanes kl
			 WHERE kl.lane OPERATOR(pg_catalog.=) idempotency._key_lane(p_scope, p_key)
			   FOR NO KEY UPDATE SKIP LOCKED;
			IF NOT FOUND THEN
				outcome := 'in_progress'; retry_after := 1; busy := 'lane';
				token := NULL; lease_until := NULL; token_lsn := NULL;
				RETURN;
			END IF;
			IF r.verdict OPERATOR(pg_catalog.&) 4 OPERATOR(pg_catalog.=) 0 THEN
				-- No other claim inserts this key now (we hold its lane): a
				-- conflict is a claim that committed since the read.
				INSERT INTO idempotency.keys AS k (scope, key, status, token, attempt,
					fingerprint, response_code, response_body, created_at, finished_at,
					lease_until, expires_at, retention, sweep_at, phase, phase_data,
					owner_session, remember, request)
				VALUES (p_scope, p_key, 'pending', _claim_key.token, 1, p_fp, NULL, NULL,
					now, NULL, _claim_key.lease_until, expires, ret, _claim_key.lease_until,
					NULL, NULL, owner, p_remember, p_request)
				ON CONFLICT (scope, key) DO NOTHING;
				GET DIAGNOSTICS n = ROW_COUNT;
			ELSE
				-- rules on the table: PostgreSQL refuses ON CONFLICT there
				BEGIN
					INSERT INTO idempotency.keys AS k (scope, key, status, token, attempt,
						fingerprint, response_code, response_body, created_at, finished_at,
						lease_until, expires_at, retention, sweep_at, phase, phase_data,
						owner_session, remember, request)
					VALUES (p_scope, p_key, 'pending', _claim_key.token, 1, p_fp, NULL, NULL,
						now, NULL, _claim_key.lease_until, expires, ret, _claim_key.lease_until,
						NULL, NULL, owner, p_remember, p_request);
					n := 1;
				EXCEPTION WHEN unique_violation THEN
					IF pg_catalog.current_setting('transaction_isolation') OPERATOR(pg_catalog.<>) 'read committed' THEN
						RAISE EXCEPTION 'could not serialize access due to concurrent update of an idempotency key'
							USING ERRCODE = '40001', HINT = 'Retry the transaction.';
					END IF;
					n := 0;
				END;
			END IF;
			IF n OPERATOR(pg_catalog.=) 0 THEN
				-- a claim committed since the read: decide once more
				token := NULL; lease_until := NULL; token_lsn := NULL;
				CONTINUE;
			END IF;
			attempt := 1;
		ELSE
			SELECT k.ctid AS tid, k.status, k.token, k.attempt, k.fingerprint,
				   k.created_at, k.lease_until, k.expires_at, k.sweep_at, k.phase,
				   k.phase_data, k.owner_session, k.remember
			  INTO l
			  FROM idempotency.keys k
			 WHERE k.scope OPERATOR(pg_catalog.=) p_scope AND k.key OPERATOR(pg_catalog.=) p_key
			   FOR NO KEY UPDATE SKIP LOCKED;
			IF NOT FOUND THEN
				-- another transaction holds the row (the next read says so),
				-- or it was deleted since (the next read finds no key)
				lease_until := NULL;
				CONTINUE;
			END IF;
			-- the newest committed version, locked: judge it once more
			IF l.expires_at OPERATOR(pg_catalog.<=) now AND
			   NOT idempotency._remembered(l.status, l.expires_at, l.remember, now) THEN
				action := 'fresh';
			ELSIF l.expires_at OPERATOR(pg_catalog.<=) now OR l.fingerprint IS DISTINCT FROM p_fp OR l.status OPERATOR(pg_catalog.<>) 'pending' OR
				  (l.token IS NOT NULL AND l.lease_until OPERATOR(pg_catalog.>) now AND
				   (l.owner_session IS NULL OR idempotency._session_alive(l.owner_session))) THEN
				lease_until := NULL;
				CONTINUE;		-- changed since the read: decide once more
			ELSE
				action := 'takeover';
			END IF;
			token := pg_catalog.nextval('idempotency.token_seq'::pg_catalog.regclass);
			token_lsn := pg_catalog.pg_current_wal_insert_lsn();
			IF action OPERATOR(pg_catalog.=) 'fresh' THEN
				attempt := 1;
				UPDATE idempotency.keys k
				   SET status = 'pending', token = _claim_key.token, attempt = 1,
					   fingerprint = p_fp, response_code = NULL, response_body = NULL,
					   created_at = now, finished_at = NULL,
					   lease_until = _claim_key.lease_until, expires_at = expires,
					   retention = ret, sweep_at = LEAST(l.sweep_at, _claim_key.lease_until),
					   phase = NULL, phase_data = NULL, owner_session = owner,
					   remember = p_remember, request = p_request
				 WHERE k.ctid OPERATOR(pg_catalog.=) l.tid;
			ELSE
				attempt := l.attempt OPERATOR(pg_catalog.+) 1;
				phase := l.phase;
				phase_data := l.phase_data;
				UPDATE idempotency.keys k
				   SET token = _claim_key.token, attempt = _claim_key.attempt,
					   lease_until = _claim_key.lease_until, expires_at = expires,
					   retention = ret, sweep_at = LEAST(l.sweep_at, _claim_key.lease_until),
					   owner_session = owner, remember = p_remember,
					   request = COALESCE(p_request, k.request)
				 WHERE k.ctid OPERATOR(pg_catalog.=) l.tid;
			END IF;
		END IF;
		IF saved IS NOT NULL THEN
			PERFORM idempotency._settings_restore(saved);
		END IF;
		IF first IS NULL OR first OPERATOR(pg_catalog.=) '' THEN
			first := pg_catalog.current_setting('idempotency_sql.xact_first_token', true);
			IF first IS NULL OR first OPERATOR(pg_catalog.=) '' THEN
				PERFORM pg_catalog.set_config('idempotency_sql.xact_first_token', token::text, true);
			END IF;
		END IF;
		outcome := 'claimed';
		lease_until := NULL;
		RETURN;
	END LOOP;
	outcome := 'in_progress'; retry_after := 1; busy := 'row';
	token := NULL; attempt := NULL; phase := NULL; phase_data := NULL;
	lease_until := NULL; token_lsn := NULL;
END;
$$;

/*
 * Make the token sequence's position durable before a token leaves the
 * server: a value handed out under a sequence record that is not flushed
 * yet could be handed out again after a crash.  "lsn" is the WAL insert
 * position read just after the token was drawn, at or past the end of the
 * sequence record that covers it (the draw that wrote the record held the
 * sequence's buffer lock until it was inserted): nothing to do when the
 * WAL is flushed that far (with other sessions writing, it seldom is:
 * their WAL lies before that position too).  SQL
 * cannot flush up to a position: from PostgreSQL 17 on a tiny
 * non-transactional WAL message flushes everything before it
 * (pg_logical_emit_message(..., flush)); before 17 the commit's flush is
 * all there is (documented).  Nor can a session remember that the record
 * covering some later tokens is already flushed: the first draw after a
 * checkpoint writes a new record for values the older one covered, and
 * after a crash the sequence resumes from the page that checkpoint wrote,
 * so only the WAL position after this very draw is safe to flush to.
 */
CREATE OR REPLACE FUNCTION idempotency._flush_tokens(lsn pg_lsn)
RETURNS void
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
	IF lsn IS NOT NULL AND pg_catalog.pg_current_wal_flush_lsn() OPERATOR(pg_catalog.<) lsn
	   AND pg_catalog.current_setting('server_version_num')::integer OPERATOR(pg_catalog.>=) 170000 THEN
		PERFORM pg_catalog.pg_logical_emit_message(false, 'idempotency', '', true);
	END IF;
END;
$$;

-- versions before 1.7.0 had no remember argument, before 1.8.0 no
-- keep_request (01_update.sql)
DO $do$
BEGIN
	PERFORM idempotency._update_set_aside(
		'idempotency.idem_claim(text,jsonb,text,interval,interval,interval,boolean)');
	PERFORM idempotency._update_set_aside(
		'idempotency.idem_claim(text,jsonb,text,interval,interval,interval,boolean,interval)');
END;
$do$;

/*
 * idem_claim: check the arguments, claim, and with "wait" wait until the
 * attempt in flight settles or its lease ends.  Most calls of a busy key
 * are answered by its first statement alone: with plain arguments, one
 * query reads the key, the caller's binding and the store's verdict and
 * answers a replay, a mismatch or a live claim of another attempt (without
 * "wait") when the key's newest version is committed and untouched
 * (xmax = 0), the row sound, the scope allowed and not past retention.
 * Everything else (a new, expired or remembered key, a takeover, a row
 * being changed, a claim of this transaction, a refusal, a bad argument)
 * takes the full path below, which decides again from scratch.  A key another transaction
 * holds (a claim, takeover, finish, release or sweep not committed yet) is
 * waited for as PostgreSQL waits for that transaction, on the row's lock
 * or the key's lane's, so the wait ends when that transaction (or the
 * savepoint it made the change in) does.  A key held by an attempt whose
 * claim committed is polled, 1 ms at first, backing off to 10 ms, and
 * never past the lease's end.  With keep_request a claim that writes keeps
 * the request for a completer (idem_claim_abandoned), and a request larger
 * than a response body may be is refused before anything is read.
 */
CREATE OR REPLACE FUNCTION idempotency.idem_claim(
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
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE ROWS 1 SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
	who name;
	role oid;
	w record;
	fp bytea;
	deadline timestamptz;
	now timestamptz;
	pause double precision := 0.001;
	sleep double precision;
	remaining bigint;
	tok bigint;
	lsn pg_lsn;
	ls interval;
	rt interval;
	rem interval;
	kept jsonb;
BEGIN
	IF NOT (key IS NULL OR pg_catalog.octet_length(key) OPERATOR(pg_catalog.=) 0 OR
			pg_catalog.octet_length(key) OPERATOR(pg_catalog.>) 255 OR
			scope IS NULL OR pg_catalog.octet_length(scope) OPERATOR(pg_catalog.>) 255 OR
			wait IS NULL OR wait OPERATOR(pg_catalog.<) '0'::interval OR session_bound IS NULL OR
			(lease IS NOT NULL AND NOT (lease OPERATOR(pg_catalog.>) '0'::interval AND
				lease OPERATOR(pg_catalog.<=) '10000 years'::interval AND
				pg_catalog.clock_timestamp() OPERATOR(pg_catalog.+) lease OPERATOR(pg_catalog.>) pg_catalog.clock_timestamp())) OR
			(retention IS NOT NULL AND NOT (retention OPERATOR(pg_catalog.>) '0'::interval AND
				retention OPERATOR(pg_catalog.<=) '10000 years'::interval AND
				pg_catalog.clock_timestamp() OPERATOR(pg_catalog.+) retention OPERATOR(pg_catalog.>) pg_catalog.clock_timestamp())) OR
			(remember IS NOT NULL AND NOT (remember OPERATOR(pg_catalog.=) '0'::interval OR
				(remember OPERATOR(pg_catalog.>) '0'::interval AND
				 remember OPERATOR(pg_catalog.<=) '10000 years'::interval AND
				 pg_catalog.clock_timestamp() OPERATOR(pg_catalog.+) remember OPERATOR(pg_catalog.>) pg_catalog.clock_timestamp()))) OR
			(keep_request AND idempotency._request_too_large(request)) OR
			pg_catalog.pg_is_in_recovery() OR pg_catalog.current_setting('transaction_read_only')::boolean OR
			pg_catalog.to_regclass('idempotency.keys') IS NULL OR
			pg_catalog.to_regclass('idempotency.scope_bindings') IS NULL) THEN
		-- One read answers, or says nothing (the full path then decides).
		-- A replay or a mismatch is answered from a version nobody locked
		-- (xmax 0) or only its own writer, which has ended or is this
		-- transaction (xmax = xmin: a token call locks the row it then
		-- updates, and the new version keeps that lock); a live claim only
		-- from a version nobody locked.  A key past its retention, remembered
		-- or not, is the full path's, so that this query's plan stays that
		-- of a key without remember.
		SELECT CASE
				 WHEN v.verdict IS NULL OR v.refused THEN NULL
				 WHEN k.ctid IS NULL THEN
					  CASE WHEN v.verdict OPERATOR(pg_catalog.=) 0 AND NOT idem_claim.session_bound
						   THEN 'fresh' END
				 WHEN k.expires_at OPERATOR(pg_catalog.<=) v.now OR
					  pg_catalog.octet_length(k.fingerprint) OPERATOR(pg_catalog.<>) 32 OR
					  (k.xmax OPERATOR(pg_catalog.<>) '0'::xid AND k.xmax OPERATOR(pg_catalog.<>) k.xmin) THEN NULL
				 WHEN k.fingerprint IS DISTINCT FROM v.fp THEN
					  CASE WHEN k.status OPERATOR(pg_catalog.=) ANY (ARRAY['pending', 'succeeded', 'failed'])
						   THEN 'mismatch' END
				 WHEN k.status OPERATOR(pg_catalog.=) ANY (ARRAY['succeeded', 'failed']) THEN 'replay'
				 WHEN k.status OPERATOR(pg_catalog.=) 'pending' AND k.xmax OPERATOR(pg_catalog.=) '0'::xid AND
					  idem_claim.wait OPERATOR(pg_catalog.=) '0'::interval AND
					  k.token IS NOT NULL AND k.owner_session IS NULL AND
					  k.lease_until OPERATOR(pg_catalog.>) v.now AND
					  (COALESCE(v.first, '') OPERATOR(pg_catalog.=) '' OR
					   k.token OPERATOR(pg_catalog.<) v.first::bigint) THEN 'in_progress'
				 END AS outcome,
			   k.status, k.response_code, k.response_body,
			   LEAST(GREATEST(pg_catalog.ceil(EXTRACT(epoch FROM k.lease_until OPERATOR(pg_catalog.-) v.now)), 1),
					 2147483647)::integer AS retry_after,
			   v.fp, v.first
		  INTO w
		  FROM (SELECT idempotency._store_verdict() AS verdict,
					   'idempotency.token_seq'::pg_catalog.regclass AS seq,
					   pg_catalog.clock_timestamp() AS now,
					   CASE WHEN idem_claim.request IS NOT NULL THEN
						   pg_catalog.sha256(pg_catalog.convert_to(idem_claim.request::text,
							   pg_catalog.getdatabaseencoding())) END AS fp,
					   pg_catalog.current_setting('idempotency_sql.xact_first_token', true) AS first,
					   -- any binding row of the caller that refuses the scope
					   EXISTS (SELECT FROM idempotency.scope_bindings b
							   WHERE b.role::pg_catalog.oid OPERATOR(pg_catalog.=)
									 pg_catalog.to_regrole(pg_catalog.quote_ident(idempotency._caller()))
								 AND (b.scope_prefix IS NULL OR
									  NOT pg_catalog.starts_with(idem_claim.scope, b.scope_prefix))) AS refused) v
		  LEFT JOIN idempotency.keys k
			ON k.scope OPERATOR(pg_catalog.=) idem_claim.scope
		   AND k.key OPERATOR(pg_catalog.=) idem_claim.key;
		IF w.outcome OPERATOR(pg_catalog.=) 'replay' THEN
			RETURN NEXT ROW('replay', NULL, NULL, w.status, w.response_code,
				w.response_body, NULL, NULL, NULL)::idempotency.claim_result;
			RETURN;
		ELSIF w.outcome OPERATOR(pg_catalog.=) 'fresh' THEN
			-- A new key, no code attached to the table: the token, the
			-- lane's lock and the insert, as _claim_key makes them.  A busy
			-- lane or a key committed since the read takes the full path.
			ls := COALESCE(lease, idempotency._lease_setting());
			rt := COALESCE(retention, idempotency._retention_setting());
			-- the verdict again, under the table's write lock
			IF idempotency._write_verdict() OPERATOR(pg_catalog.=) 0 THEN
				tok := pg_catalog.nextval('idempotency.token_seq'::pg_catalog.regclass);
				lsn := pg_catalog.pg_current_wal_insert_lsn();
				PERFORM FROM idempotency.key_lanes kl
				 WHERE kl.lane OPERATOR(pg_catalog.=) idempotency._key_lane(idem_claim.scope, idem_claim.key)
				   FOR NO KEY UPDATE SKIP LOCKED;
			END IF;
			IF tok IS NOT NULL AND FOUND THEN
				now := pg_catalog.clock_timestamp();
				INSERT INTO idempotency.keys AS k (scope, key, status, token, attempt,
					fingerprint, response_code, response_body, created_at, finished_at,
					lease_until, expires_at, retention, sweep_at, phase, phase_data,
					owner_session, remember, request)
				VALUES (idem_claim.scope, idem_claim.key, 'pending', tok, 1, w.fp,
					NULL, NULL, now, NULL, now OPERATOR(pg_catalog.+) ls,
					GREATEST(now OPERATOR(pg_catalog.+) rt, now OPERATOR(pg_catalog.+) ls),
					rt, now OPERATOR(pg_catalog.+) ls, NULL, NULL, NULL,
					CASE WHEN idem_claim.remember IS NULL THEN idempotency._remember_setting()
						 ELSE NULLIF(idem_claim.remember, '0'::interval) END,
					CASE WHEN idem_claim.keep_request THEN idem_claim.request END)
				ON CONFLICT ON CONSTRAINT keys_pkey DO NOTHING;
				IF FOUND THEN
					IF COALESCE(w.first, '') OPERATOR(pg_catalog.=) '' THEN
						PERFORM pg_catalog.set_config('idempotency_sql.xact_first_token', tok::text, true);
					END IF;
					IF pg_catalog.pg_current_wal_flush_lsn() OPERATOR(pg_catalog.<) lsn THEN
						PERFORM idempotency._flush_tokens(lsn);
					END IF;
					RETURN NEXT ROW('claimed', tok, 1, NULL, NULL, NULL, NULL, NULL,
						NULL)::idempotency.claim_result;
					RETURN;
				END IF;
			END IF;
		ELSIF w.outcome IS NOT NULL THEN
			RETURN NEXT ROW(w.outcome, NULL, NULL, NULL, NULL, NULL,
				CASE WHEN w.outcome OPERATOR(pg_catalog.=) 'in_progress' THEN w.retry_after END,
				NULL, NULL)::idempotency.claim_result;
			RETURN;
		END IF;
	END IF;

	who := idempotency._caller();
	role := pg_catalog.to_regrole(pg_catalog.quote_ident(who));
	IF key IS NULL OR pg_catalog.octet_length(key) OPERATOR(pg_catalog.=) 0 OR
	   pg_catalog.octet_length(key) OPERATOR(pg_catalog.>) 255 THEN
		PERFORM idempotency._check_name(key, 'key', false);
	END IF;
	IF scope IS NULL OR pg_catalog.octet_length(scope) OPERATOR(pg_catalog.>) 255 THEN
		PERFORM idempotency._check_name(scope, 'scope', true);
	END IF;
	IF lease IS NOT NULL THEN
		PERFORM idempotency._check_positive(lease, 'lease');
	END IF;
	IF retention IS NOT NULL THEN
		PERFORM idempotency._check_positive(retention, 'retention');
	END IF;
	IF wait IS NULL OR wait OPERATOR(pg_catalog.<>) '0'::interval THEN
		wait := idempotency._check_wait(wait);
	END IF;
	IF session_bound IS NULL THEN
		RAISE EXCEPTION 'session_bound must not be null' USING ERRCODE = '22004';
	END IF;
	IF remember IS NOT NULL THEN
		PERFORM idempotency._check_interval(remember, 'remember', true);
	END IF;
	IF keep_request THEN
		PERFORM idempotency._check_body(request, 'request');
	END IF;
	IF pg_catalog.pg_is_in_recovery() OR pg_catalog.current_setting('transaction_read_only')::boolean THEN
		PERFORM idempotency._check_writable('idem_claim()');
	END IF;
	rem := CASE WHEN remember IS NULL THEN idempotency._remember_setting()
		   ELSE NULLIF(remember, '0'::interval) END;
	IF keep_request THEN
		kept := request;
	END IF;
	IF request IS NOT NULL THEN
		fp := pg_catalog.sha256(pg_catalog.convert_to(request::text, pg_catalog.getdatabaseencoding()));
	END IF;
	w := idempotency._claim_key(who, role, key, fp,
		scope, lease, retention, session_bound, rem, kept);
	IF w.outcome OPERATOR(pg_catalog.=) 'in_progress' AND NOT w.held
	   AND wait OPERATOR(pg_catalog.>) '0'::interval THEN
		deadline := pg_catalog.clock_timestamp() OPERATOR(pg_catalog.+) wait;
		LOOP
			now := pg_catalog.clock_timestamp();
			EXIT WHEN now OPERATOR(pg_catalog.>=) deadline;
			remaining := GREATEST(pg_catalog.ceil(EXTRACT(epoch FROM deadline OPERATOR(pg_catalog.-) now)
				OPERATOR(pg_catalog.*) 1000), 1)::bigint;
			IF w.busy OPERATOR(pg_catalog.=) 'row' THEN
				-- Wait for the transaction that holds the row as a row lock
				-- waits (so a deadlock is detected), and let the lock go at
				-- once: it only served to wait.  FOR SHARE conflicts with
				-- every change a claim, finish, release or sweep makes.
				BEGIN
					PERFORM pg_catalog.set_config('lock_timeout', remaining::text OPERATOR(pg_catalog.||) 'ms', true);
					PERFORM FROM idempotency.keys k
					 WHERE k.scope OPERATOR(pg_catalog.=) idem_claim.scope
					   AND k.key OPERATOR(pg_catalog.=) idem_claim.key
					   FOR SHARE;
					RAISE EXCEPTION 'waited' USING ERRCODE = 'IDW01';
				EXCEPTION WHEN SQLSTATE 'IDW01' OR lock_not_available THEN
					NULL;
				END;
			ELSIF w.busy OPERATOR(pg_catalog.=) 'lane' THEN
				-- another transaction inserts a key of this lane: wait on the
				-- lane's lock, which it holds to its end (or its savepoint's)
				BEGIN
					PERFORM pg_catalog.set_config('lock_timeout', remaining::text OPERATOR(pg_catalog.||) 'ms', true);
					PERFORM FROM idempotency.key_lanes kl
					 WHERE kl.lane OPERATOR(pg_catalog.=) idempotency._key_lane(idem_claim.scope, idem_claim.key)
					   FOR SHARE;
					RAISE EXCEPTION 'waited' USING ERRCODE = 'IDW01';
				EXCEPTION WHEN SQLSTATE 'IDW01' OR lock_not_available THEN
					NULL;
				END;
			ELSE
				-- a claim that committed: poll
				sleep := LEAST(pause, EXTRACT(epoch FROM deadline OPERATOR(pg_catalog.-) now)::double precision);
				IF w.lease_until IS NOT NULL AND w.lease_until OPERATOR(pg_catalog.>) now THEN
					sleep := LEAST(sleep, EXTRACT(epoch FROM w.lease_until OPERATOR(pg_catalog.-) now)::double precision);
				END IF;
				PERFORM pg_catalog.pg_sleep(GREATEST(sleep, 0.0005));
				pause := LEAST(pause OPERATOR(pg_catalog.*) 2, 0.01);
			END IF;
			w := idempotency._claim_key(who, role, key, fp,
				scope, lease, retention, session_bound, rem, kept);
			EXIT WHEN w.outcome OPERATOR(pg_catalog.<>) 'in_progress' OR w.held;
		END LOOP;
	END IF;
	IF w.token_lsn IS NOT NULL AND pg_catalog.pg_current_wal_flush_lsn() OPERATOR(pg_catalog.<) w.token_lsn THEN
		PERFORM idempotency._flush_tokens(w.token_lsn);
	END IF;
	RETURN NEXT ROW(w.outcome, w.token, w.attempt, w.status, w.response_code,
		w.response_body, w.retry_after, w.phase, w.phase_data)::idempotency.claim_result;
END;
$$;

/*
 * idem_claim_many: every argument checked first, then each element claimed
 * as idem_claim (without wait, remember from idempotency.remember, no
 * request kept) would, one after another; the tokens are made durable
 * once, before the rows leave.
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
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE ROWS 100 SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
	who name := idempotency._caller();
	role oid;
	k text[];
	req jsonb[];
	n integer;
	w record;
	lsn pg_lsn;
	ls interval;
	rt interval;
	now timestamptz;
	toks bigint[];
	lanes integer[];
	got bigint;
	verdict integer;
	rem interval;
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
		IF k[i] IS NULL OR pg_catalog.octet_length(k[i]) OPERATOR(pg_catalog.=) 0 OR
		   pg_catalog.octet_length(k[i]) OPERATOR(pg_catalog.>) 255 THEN
			PERFORM idempotency._check_name(k[i], pg_catalog.format('keys[%s]', i), false);
		END IF;
	END LOOP;
	PERFORM idempotency._check_name(scope, 'scope', true);
	PERFORM idempotency._check_positive(lease, 'lease');
	PERFORM idempotency._check_positive(retention, 'retention');
	IF session_bound IS NULL THEN
		RAISE EXCEPTION 'session_bound must not be null' USING ERRCODE = '22004';
	END IF;
	PERFORM idempotency._check_writable('idem_claim_many()');
	role := pg_catalog.to_regrole(pg_catalog.quote_ident(who));
	rem := idempotency._remember_setting();
	-- A batch of new keys, no code attached to the table, the scope allowed,
	-- not bound to the session: the tokens drawn in order, every key's lane
	-- locked without waiting, and the rows inserted by one statement, as
	-- _claim_key makes each.  All or nothing: when a lane is busy or a key
	-- was claimed meanwhile, the block's subtransaction takes back what it
	-- did (lanes and rows, not the tokens) and every element takes the loop
	-- below, in order.  Before it writes, the verdict again under the
	-- table's write lock (_write_verdict).
	IF n OPERATOR(pg_catalog.>) 0 AND NOT session_bound AND
	   pg_catalog.to_regclass('idempotency.keys') IS NOT NULL AND
	   pg_catalog.to_regclass('idempotency.scope_bindings') IS NOT NULL AND
	   (SELECT v.verdict OPERATOR(pg_catalog.=) 0 AND
			   NOT EXISTS (SELECT FROM idempotency.scope_bindings b
						   WHERE b.role::pg_catalog.oid OPERATOR(pg_catalog.=) pg_catalog.to_regrole(pg_catalog.quote_ident(who))
							 AND (b.scope_prefix IS NULL OR
								  NOT pg_catalog.starts_with(idem_claim_many.scope, b.scope_prefix))) AND
			   (SELECT pg_catalog.count(DISTINCT u) FROM pg_catalog.unnest(k) u) OPERATOR(pg_catalog.=) n AND
			   NOT EXISTS (SELECT FROM pg_catalog.unnest(k) u
						   CROSS JOIN LATERAL (
							 SELECT FROM idempotency.keys kk
							  WHERE kk.scope OPERATOR(pg_catalog.=) idem_claim_many.scope
								AND kk.key OPERATOR(pg_catalog.=) u
							  LIMIT 1) kk)
		  FROM (SELECT idempotency._store_verdict() AS verdict,
					   'idempotency.token_seq'::pg_catalog.regclass AS seq) v) THEN
		verdict := idempotency._write_verdict();
	END IF;
	IF verdict OPERATOR(pg_catalog.=) 0 THEN
		ls := COALESCE(lease, idempotency._lease_setting());
		rt := COALESCE(retention, idempotency._retention_setting());
		BEGIN
			toks := ARRAY(SELECT pg_catalog.nextval('idempotency.token_seq'::pg_catalog.regclass)
							FROM pg_catalog.generate_series(1, n));
			lsn := pg_catalog.pg_current_wal_insert_lsn();
			lanes := ARRAY(SELECT DISTINCT idempotency._key_lane(idem_claim_many.scope, u)
							 FROM pg_catalog.unnest(k) u);
			-- lane by lane (a lateral lookup each: no plan scans the lanes
			-- once per element)
			PERFORM FROM pg_catalog.unnest(lanes) l
			  CROSS JOIN LATERAL (
				SELECT FROM idempotency.key_lanes kl
				 WHERE kl.lane OPERATOR(pg_catalog.=) l
				   FOR NO KEY UPDATE SKIP LOCKED) kl;
			GET DIAGNOSTICS got = ROW_COUNT;
			IF got OPERATOR(pg_catalog.<>) pg_catalog.cardinality(lanes) THEN
				RAISE EXCEPTION 'a lane is busy' USING ERRCODE = 'IDB01';
			END IF;
			now := pg_catalog.clock_timestamp();
			INSERT INTO idempotency.keys AS kk (scope, key, status, token, attempt,
				fingerprint, response_code, response_body, created_at, finished_at,
				lease_until, expires_at, retention, sweep_at, phase, phase_data,
				owner_session, remember)
			SELECT idem_claim_many.scope, u.key, 'pending', u.tok, 1,
				   CASE WHEN u.req IS NOT NULL THEN
					   pg_catalog.sha256(pg_catalog.convert_to(u.req::text,
						   pg_catalog.getdatabaseencoding())) END,
				   NULL, NULL, now, NULL, now OPERATOR(pg_catalog.+) ls,
				   GREATEST(now OPERATOR(pg_catalog.+) rt, now OPERATOR(pg_catalog.+) ls),
				   rt, now OPERATOR(pg_catalog.+) ls, NULL, NULL, NULL, rem
			  FROM ROWS FROM (pg_catalog.unnest(k), pg_catalog.unnest(toks), pg_catalog.unnest(req))
				   WITH ORDINALITY u(key, tok, req, i)
			 ORDER BY u.i
			ON CONFLICT ON CONSTRAINT keys_pkey DO NOTHING;
			GET DIAGNOSTICS got = ROW_COUNT;
			IF got OPERATOR(pg_catalog.<>) n THEN
				RAISE EXCEPTION 'a key was claimed meanwhile' USING ERRCODE = 'IDB01';
			END IF;
		EXCEPTION WHEN SQLSTATE 'IDB01' THEN
			toks := NULL;
		END;
		IF toks IS NOT NULL THEN
			IF COALESCE(pg_catalog.current_setting('idempotency_sql.xact_first_token', true), '')
				   OPERATOR(pg_catalog.=) '' THEN
				PERFORM pg_catalog.set_config('idempotency_sql.xact_first_token', toks[1]::text, true);
			END IF;
			IF pg_catalog.pg_current_wal_flush_lsn() OPERATOR(pg_catalog.<) lsn THEN
				PERFORM idempotency._flush_tokens(lsn);
			END IF;
			RETURN QUERY SELECT u.i::integer, u.key, 'claimed'::text, u.tok, 1,
				NULL::text, NULL::integer, NULL::jsonb, NULL::integer, NULL::text, NULL::jsonb
			  FROM ROWS FROM (pg_catalog.unnest(k), pg_catalog.unnest(toks)) WITH ORDINALITY u(key, tok, i);
			RETURN;
		END IF;
		lsn := NULL;
	END IF;
	FOR i IN 1..n LOOP
		w := idempotency._claim_key(who, role, k[i],
			CASE WHEN req[i] IS NOT NULL THEN
				pg_catalog.sha256(pg_catalog.convert_to(req[i]::text, pg_catalog.getdatabaseencoding())) END,
			scope, lease, retention, session_bound, rem, NULL);
		IF w.token_lsn IS NOT NULL THEN
			lsn := GREATEST(lsn, w.token_lsn);
		END IF;
		ord := i; key := k[i]; outcome := w.outcome; token := w.token;
		attempt := w.attempt; status := w.status; response_code := w.response_code;
		response_body := w.response_body; retry_after := w.retry_after;
		phase := w.phase; phase_data := w.phase_data;
		RETURN NEXT;
	END LOOP;
	-- the rows leave when the function returns: one flush for all tokens
	PERFORM idempotency._flush_tokens(lsn);
END;
$$;

/* ---------------------------------------------------------------------
 * Completers (claim.c)
 * ---------------------------------------------------------------------
 */

/*
 * Take over, in one call, up to max_keys abandoned keys of the scope: a
 * key pending within its retention whose token a sweep cleared, whose
 * lease ended, or whose session-bound owner's session ended.  Oldest
 * first (ties: key); each row is a claimed takeover (attempt + 1, a new
 * token, the old one dead, a lease of "lease", not bound to a session),
 * with the request the key was claimed with when that claim kept it and
 * the last recovery point.  A key another transaction is changing or
 * locking, or that this transaction's own claim holds, is skipped, never
 * waited for.  The keys a sweep has not visited yet are looked for among
 * the first entries of the indexes every scope shares only (as many as
 * the C edition reads), so that a sweep's backlog does not make every
 * call read it whole: once a sweep resets them, keys_abandoned_idx finds
 * them by scope, the oldest first, a page at a time, so that a scope with
 * many reset keys costs a call only the ones it reads.
 */
CREATE OR REPLACE FUNCTION idempotency.idem_claim_abandoned(
	scope		text		DEFAULT '',
	max_keys	integer		DEFAULT 1,
	lease		interval	DEFAULT NULL)
RETURNS TABLE (key text, token bigint, attempt integer, request jsonb,
			   phase text, phase_data jsonb)
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE ROWS 10 SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
	who name := idempotency._caller();
	r record;
	c record;
	now timestamptz;
	lease_end timestamptz;
	cap integer;
	page integer;
	cur refcursor;
	seen integer;
	last_created timestamptz;
	last_key text;
	dead bigint[];
	first bigint;
	snap pg_snapshot;
	tids tid[] := '{}';
	ks text[] := '{}';
	attempts integer[] := '{}';
	requests jsonb[] := '{}';
	phases text[] := '{}';
	datas jsonb[] := '{}';
	toks bigint[];
	lsn pg_lsn;
	n integer := 0;
	got bigint;
	saved jsonb;
BEGIN
	PERFORM idempotency._check_name(scope, 'scope', true);
	IF max_keys IS NULL THEN
		RAISE EXCEPTION 'max_keys must not be null' USING ERRCODE = '22004';
	END IF;
	IF max_keys OPERATOR(pg_catalog.<) 1 OR max_keys OPERATOR(pg_catalog.>) 10000 THEN
		RAISE EXCEPTION 'max_keys must be between 1 and 10000' USING ERRCODE = '22023';
	END IF;
	PERFORM idempotency._check_positive(lease, 'lease');
	PERFORM idempotency._check_writable('idem_claim_abandoned()');
	IF pg_catalog.to_regclass('idempotency.keys') IS NULL OR
	   pg_catalog.to_regclass('idempotency.scope_bindings') IS NULL THEN
		PERFORM idempotency._check_store();
	END IF;
	-- Row exclusive on the table before the store's verdict is read (see
	-- idem_claim).
	LOCK TABLE idempotency.keys IN ROW EXCLUSIVE MODE;
	SELECT v.verdict, b.role IS NOT NULL AS bound, b.scope_prefix AS prefix
	  INTO r
	  FROM (SELECT idempotency._store_verdict() AS verdict,
				   'idempotency.token_seq'::pg_catalog.regclass AS seq) v
	  LEFT JOIN idempotency.scope_bindings b
		ON b.role::pg_catalog.oid OPERATOR(pg_catalog.=) pg_catalog.to_regrole(pg_catalog.quote_ident(who))
	  LEFT JOIN idempotency.keys k ON false;
	IF r.bound AND (r.prefix IS NULL OR NOT pg_catalog.starts_with(scope, r.prefix)) THEN
		PERFORM idempotency._tenant_refuse(who, scope, r.prefix);
	END IF;

	now := pg_catalog.clock_timestamp();
	lease_end := now OPERATOR(pg_catalog.+) COALESCE(lease, idempotency._lease_setting());
	cap := GREATEST(max_keys OPERATOR(pg_catalog.*) 16, 1024);
	page := max_keys OPERATOR(pg_catalog.*) 2 OPERATOR(pg_catalog.+) 8;
	-- the ended sessions among the owners of the scope's session-bound keys
	dead := ARRAY(SELECT s.o
					FROM (SELECT DISTINCT b.owner_session AS o
							FROM (SELECT k.owner_session, k.scope
									FROM idempotency.keys k
								   WHERE k.owner_session IS NOT NULL
								   LIMIT cap) b
						   WHERE b.scope OPERATOR(pg_catalog.=) idem_claim_abandoned.scope) s
				   WHERE NOT idempotency._session_alive(s.o));
	-- A claim of this transaction holds a key under a token it drew (from
	-- its first on), in a row version it wrote.
	first := NULLIF(pg_catalog.current_setting('idempotency_sql.xact_first_token', true), '')::bigint;
	IF first IS NOT NULL THEN
		snap := pg_catalog.pg_current_snapshot();
	END IF;

	-- The candidates in order, a page at a time (the next page starts after
	-- the last candidate of the one before), each joined to its row locked
	-- without waiting and judged again on its newest committed version
	-- (SKIP LOCKED reads it, and its conditions are checked once more
	-- there): a candidate another transaction holds, or no longer
	-- abandoned, joins no row.  Each row is fetched alone, so that the join
	-- locks no key past the max_keys-th (a loop over a query would read
	-- rows ahead).  A page holds the oldest reset keys of the scope by
	-- keys_abandoned_idx, as many as the page's size, and not every reset
	-- key the scope has.  The three kinds are disjoint: reset (token NULL),
	-- lease ended, session ended under a running lease.
	LOOP
		seen := 0;
		OPEN cur FOR
			SELECT a.key AS cand, a.created_at AS cand_created, l.tid, l.key, l.attempt,
				   l.request, l.phase, l.phase_data
			  FROM (SELECT b.key, b.created_at
					  FROM ((SELECT k.key, k.created_at
							   FROM idempotency.keys k
							  WHERE k.scope OPERATOR(pg_catalog.=) idem_claim_abandoned.scope
								AND k.token IS NULL
								AND k.created_at OPERATOR(pg_catalog.>=) COALESCE(last_created, '-infinity')
								AND (last_key IS NULL OR
									 (k.created_at, k.key) OPERATOR(pg_catalog.>) (last_created, last_key))
								AND k.status OPERATOR(pg_catalog.=) 'pending'
								AND k.expires_at OPERATOR(pg_catalog.>) now
							  ORDER BY k.created_at, k.key
							  LIMIT page)
							UNION ALL
							SELECT d.key, d.created_at
							  FROM (SELECT k.scope, k.key, k.status, k.token, k.lease_until, k.created_at, k.expires_at
									  FROM idempotency.keys k
									 WHERE k.sweep_at OPERATOR(pg_catalog.<=) now
									 ORDER BY k.sweep_at
									 LIMIT cap) d
							 WHERE d.scope OPERATOR(pg_catalog.=) idem_claim_abandoned.scope
							   AND d.token IS NOT NULL
							   AND d.status OPERATOR(pg_catalog.=) 'pending'
							   AND d.lease_until OPERATOR(pg_catalog.<=) now
							   AND d.expires_at OPERATOR(pg_catalog.>) now
							   AND (last_key IS NULL OR
									(d.created_at, d.key) OPERATOR(pg_catalog.>) (last_created, last_key))
							UNION ALL
							SELECT k.key, k.created_at
							  FROM idempotency.keys k
							 WHERE k.owner_session OPERATOR(pg_catalog.=) ANY (dead)
							   AND k.scope OPERATOR(pg_catalog.=) idem_claim_abandoned.scope
							   AND k.token IS NOT NULL
							   AND k.status OPERATOR(pg_catalog.=) 'pending'
							   AND k.lease_until OPERATOR(pg_catalog.>) now
							   AND k.expires_at OPERATOR(pg_catalog.>) now
							   AND (last_key IS NULL OR
									(k.created_at, k.key) OPERATOR(pg_catalog.>) (last_created, last_key))) b
					 ORDER BY b.created_at, b.key
					 LIMIT page) a
			  LEFT JOIN LATERAL (
				SELECT k.ctid AS tid, k.key, k.attempt, k.request, k.phase, k.phase_data
				  FROM idempotency.keys k
				 WHERE k.scope OPERATOR(pg_catalog.=) idem_claim_abandoned.scope
				   AND k.key OPERATOR(pg_catalog.=) a.key
				   AND k.status OPERATOR(pg_catalog.=) 'pending'
				   AND k.expires_at OPERATOR(pg_catalog.>) now
				   AND (k.token IS NULL OR k.lease_until OPERATOR(pg_catalog.<=) now OR
						k.owner_session OPERATOR(pg_catalog.=) ANY (dead))
				   AND k.attempt IS NOT NULL AND k.created_at IS NOT NULL
				   AND k.retention IS NOT NULL AND k.sweep_at IS NOT NULL
				   AND (k.fingerprint IS NULL OR pg_catalog.octet_length(k.fingerprint) OPERATOR(pg_catalog.=) 32)
				   AND NOT CASE WHEN k.token OPERATOR(pg_catalog.>=) first
								THEN pg_catalog.pg_xact_status(idempotency._xid8(k.xmin, snap))
									 IS NOT DISTINCT FROM 'in progress'
								ELSE false END
				   FOR NO KEY UPDATE OF k SKIP LOCKED) l ON true
			 ORDER BY a.created_at, a.key;
		LOOP
			EXIT WHEN n OPERATOR(pg_catalog.>=) max_keys;
			FETCH cur INTO c;
			EXIT WHEN NOT FOUND;
			seen := seen OPERATOR(pg_catalog.+) 1;
			last_created := c.cand_created;
			last_key := c.cand;
			CONTINUE WHEN c.tid IS NULL;
			tids := pg_catalog.array_append(tids, c.tid);
			ks := pg_catalog.array_append(ks, c.key);
			attempts := pg_catalog.array_append(attempts, c.attempt OPERATOR(pg_catalog.+) 1);
			requests := pg_catalog.array_append(requests, c.request);
			phases := pg_catalog.array_append(phases, c.phase);
			datas := pg_catalog.array_append(datas, c.phase_data);
			n := n OPERATOR(pg_catalog.+) 1;
		END LOOP;
		CLOSE cur;
		EXIT WHEN n OPERATOR(pg_catalog.>=) max_keys OR seen OPERATOR(pg_catalog.<) page;
	END LOOP;
	IF n OPERATOR(pg_catalog.=) 0 THEN
		RETURN;
	END IF;

	-- Each a claim's takeover: tokens in the order of the rows, the lease
	-- from now, the key's own retention, no session; created_at,
	-- fingerprint, remember, the kept request and the recovery point stay.
	IF r.verdict OPERATOR(pg_catalog.<>) 0 THEN
		PERFORM idempotency._refuse_write(r.verdict);
	END IF;
	toks := ARRAY(SELECT pg_catalog.nextval('idempotency.token_seq'::pg_catalog.regclass)
					FROM pg_catalog.generate_series(1, n));
	lsn := pg_catalog.pg_current_wal_insert_lsn();
	IF r.verdict OPERATOR(pg_catalog.&) 1 OPERATOR(pg_catalog.=) 0 THEN
		UPDATE idempotency.keys k
		   SET token = u.tok, attempt = k.attempt OPERATOR(pg_catalog.+) 1,
			   lease_until = lease_end,
			   expires_at = GREATEST(now OPERATOR(pg_catalog.+) k.retention,
									 lease_end),
			   sweep_at = LEAST(k.sweep_at, lease_end),
			   owner_session = NULL
		  FROM ROWS FROM (pg_catalog.unnest(tids), pg_catalog.unnest(toks)) u(tid, tok)
		 WHERE k.ctid OPERATOR(pg_catalog.=) ANY (tids)
		   AND k.ctid OPERATOR(pg_catalog.=) u.tid;
		GET DIAGNOSTICS got = ROW_COUNT;
		IF got OPERATOR(pg_catalog.<>) n THEN
			RAISE EXCEPTION 'idempotency key changed during a write'
				USING ERRCODE = '40001',
					  DETAIL = 'Someone changed idempotency.keys outside the extension''s functions.',
					  HINT = 'Retry the transaction.';
		END IF;
	END IF;
	FOR i IN 1..n LOOP
		IF r.verdict OPERATOR(pg_catalog.&) 1 OPERATOR(pg_catalog.<>) 0 THEN
			-- the table runs a user's code: row by row, the settings set
			-- back after each (see _sweep_rows); a row that code kept from
			-- being written is not taken over
			saved := idempotency._settings_save();
			UPDATE idempotency.keys k
			   SET token = toks[i], attempt = k.attempt OPERATOR(pg_catalog.+) 1,
				   lease_until = lease_end,
				   expires_at = GREATEST(now OPERATOR(pg_catalog.+) k.retention,
										 lease_end),
				   sweep_at = LEAST(k.sweep_at, lease_end),
				   owner_session = NULL
			 WHERE k.ctid OPERATOR(pg_catalog.=) tids[i];
			GET DIAGNOSTICS got = ROW_COUNT;
			PERFORM idempotency._settings_restore(saved);
			CONTINUE WHEN got OPERATOR(pg_catalog.=) 0;
		END IF;
		key := ks[i]; token := toks[i]; attempt := attempts[i];
		request := requests[i]; phase := phases[i]; phase_data := datas[i];
		RETURN NEXT;
	END LOOP;
	IF first IS NULL THEN
		PERFORM pg_catalog.set_config('idempotency_sql.xact_first_token', toks[1]::text, true);
	END IF;
	-- the rows leave when the function returns: one flush for all tokens
	IF pg_catalog.pg_current_wal_flush_lsn() OPERATOR(pg_catalog.<) lsn THEN
		PERFORM idempotency._flush_tokens(lsn);
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

-- versions before 1.7.0 had no p_remember (01_update.sql)
DO $do$
BEGIN
	PERFORM idempotency._update_set_aside(
		'idempotency._token_call(name,oid,text,text,bigint,text,integer,jsonb,text,interval,text)');
END;
$do$;

/*
 * One token holder's call, the arguments checked: finish, extend, release
 * or checkpoint the key for the role p_who (oid p_role).  The common case
 * is one query and one write: the row is locked without waiting (FOR NO
 * KEY UPDATE SKIP LOCKED, which reads its newest committed version) only
 * if it is pending under this token within its retention and the binding
 * allows the scope, then written.  Otherwise the committed row says why
 * (absent or past its retention: P0002; finished: 55000; another token's:
 * 55006; the token current but another transaction holding the row:
 * 55P03, or a wait while the lease runs, see below), and no row stays
 * locked.  Returns the key's expiry (finish), the new lease end (extend),
 * or NULL.  A finish stores p_remember (0: not remembered) or, when it is
 * NULL, keeps the claim's, and drops the request a claim kept.  A finish repeated with the token that finished
 * the key answers that finish's expiry and writes nothing.  A remembered
 * key is past its retention: P0002, as for any such key.  No SET clause of its own: it
 * runs only inside the API functions, which pin search_path and the plan
 * cache mode (see _claim_key).
 */
CREATE OR REPLACE FUNCTION idempotency._token_call(p_who name, p_role oid, kind text,
	p_key text, p_token bigint, p_scope text, p_code integer, p_body jsonb,
	p_status text, p_interval interval, p_phase text, p_remember interval,
	OUT result timestamptz, OUT wrote boolean)
LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
	now timestamptz;
	r record;
	p record;
	disp text;
	hold text;
	row_held boolean;
	step text;
	saved jsonb;
	n bigint;
	rounds integer := 0;
	held_rounds integer := 0;
BEGIN
	wrote := false;
	IF pg_catalog.to_regclass('idempotency.keys') IS NULL OR
	   pg_catalog.to_regclass('idempotency.scope_bindings') IS NULL THEN
		PERFORM idempotency._check_store();
	END IF;
	-- Row exclusive on the table before the store's verdict is read: a
	-- lock this transaction did not hold yet makes it take in the DDL
	-- committed meanwhile, and while it is held no code can be attached.
	LOCK TABLE idempotency.keys IN ROW EXCLUSIVE MODE;
	LOOP
		now := pg_catalog.clock_timestamp();
		SELECT v.verdict, b.role IS NOT NULL AS bound, b.scope_prefix AS prefix,
			   k.tid, k.attempt, k.created_at, k.expires_at, k.retention, k.sweep_at,
			   k.fingerprint
		  INTO r
		  FROM (SELECT idempotency._store_verdict() AS verdict,
					   'idempotency.token_seq'::pg_catalog.regclass AS seq) v
		  LEFT JOIN idempotency.scope_bindings b
			ON b.role::pg_catalog.oid OPERATOR(pg_catalog.=) p_role
		  LEFT JOIN LATERAL (
			SELECT k.ctid AS tid, k.attempt, k.created_at, k.expires_at, k.retention,
				   k.sweep_at, k.fingerprint
			  FROM idempotency.keys k
			 WHERE k.scope OPERATOR(pg_catalog.=) p_scope AND k.key OPERATOR(pg_catalog.=) p_key
			   AND k.status OPERATOR(pg_catalog.=) 'pending' AND k.token OPERATOR(pg_catalog.=) p_token
			   AND k.expires_at OPERATOR(pg_catalog.>) now
			   AND (b.role IS NULL OR pg_catalog.starts_with(p_scope, b.scope_prefix))
			   FOR NO KEY UPDATE OF k SKIP LOCKED) k ON true;
		IF r.bound AND (r.prefix IS NULL OR NOT pg_catalog.starts_with(p_scope, r.prefix)) THEN
			PERFORM idempotency._tenant_refuse(p_who, p_scope, r.prefix);
		END IF;
		IF r.tid IS NOT NULL THEN
			-- the token holds the key, and the row is locked: write
			IF r.attempt IS NULL OR r.created_at IS NULL OR r.retention IS NULL OR
			   r.sweep_at IS NULL OR pg_catalog.octet_length(r.fingerprint) OPERATOR(pg_catalog.<>) 32 THEN
				PERFORM idempotency._check_row(p_scope, p_key, 'pending', r.attempt,
					r.created_at, r.expires_at, r.retention, r.sweep_at, r.fingerprint);
			END IF;
			IF r.verdict OPERATOR(pg_catalog.<>) 0 THEN
				PERFORM idempotency._refuse_write(r.verdict);
				saved := idempotency._settings_save();
			END IF;
			IF kind OPERATOR(pg_catalog.=) 'finish' THEN
				result := now OPERATOR(pg_catalog.+) COALESCE(p_interval, r.retention);
				UPDATE idempotency.keys k
				   SET status = p_status, response_code = p_code,
					   response_body = p_body, finished_at = now,
					   lease_until = NULL, expires_at = result,
					   sweep_at = LEAST(r.sweep_at, result), owner_session = NULL,
					   remember = CASE WHEN p_remember IS NULL THEN k.remember
								  ELSE NULLIF(p_remember, '0'::interval) END,
					   request = NULL
				 WHERE k.ctid OPERATOR(pg_catalog.=) r.tid;
			ELSIF kind OPERATOR(pg_catalog.=) 'extend' THEN
				p_interval := COALESCE(p_interval, idempotency._lease_setting());
				result := now OPERATOR(pg_catalog.+) p_interval;
				UPDATE idempotency.keys k
				   SET lease_until = result,
					   expires_at = GREATEST(now OPERATOR(pg_catalog.+) r.retention, result)
				 WHERE k.ctid OPERATOR(pg_catalog.=) r.tid;
			ELSIF kind OPERATOR(pg_catalog.=) 'release' THEN
				DELETE FROM idempotency.keys k WHERE k.ctid OPERATOR(pg_catalog.=) r.tid;
			ELSE
				UPDATE idempotency.keys k
				   SET phase = p_phase, phase_data = p_body
				 WHERE k.ctid OPERATOR(pg_catalog.=) r.tid;
			END IF;
			GET DIAGNOSTICS n = ROW_COUNT;
			IF saved IS NOT NULL THEN
				PERFORM idempotency._settings_restore(saved);
			END IF;
			IF n OPERATOR(pg_catalog.<>) 1 THEN
				RAISE EXCEPTION 'idempotency key changed during a write'
					USING ERRCODE = '40001',
						  DETAIL = 'Someone changed idempotency.keys outside the extension''s functions.',
						  HINT = 'Retry the transaction.';
			END IF;
			wrote := true;
			RETURN;
		END IF;

		-- Not locked: say why from the committed row, as a claim reads it.
		disp := idempotency._key_display(p_scope, p_key);
		SELECT * INTO p FROM idempotency._probe(p_scope, p_key);
		step := 'go';
		row_held := false;
		-- Another transaction is changing a key whose committed row is this
		-- token's claim.  Without a dirty read the SQL edition cannot see the
		-- new version, so it tells the change by the row lock it holds,
		-- asked without waiting.  While the lease runs, only the token's
		-- holder (an extend, checkpoint, finish or release made elsewhere), a
		-- sweep moving sweep_at, or plain SQL changes the key: an update of
		-- other columns than the key leaves the token current and is waited
		-- for, as a row lock waits (so a deadlock is detected), and the key
		-- is read again.  A delete (a release) or a plain row lock is not
		-- waited for, and neither is any change once the lease has ended (it
		-- may be a takeover): the call is refused (55P03 below).  The
		-- probe's "busy" may be stale (that transaction has ended), so the
		-- lock is asked of the row itself; a version that is gone by then
		-- was replaced by a change that has committed: read again.
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
					RETURN;
				END IF;
				RAISE EXCEPTION 'idempotency key % is already finished', disp
					USING ERRCODE = '55000',
						  DETAIL = CASE WHEN kind OPERATOR(pg_catalog.=) 'finish'
							THEN 'Another attempt stored its result.'
							ELSE pg_catalog.format('Its status is "%s".', p.status) END;
			ELSIF p.token IS DISTINCT FROM p_token THEN
				RAISE EXCEPTION 'token % is not the current token of idempotency key %', p_token, disp
					USING ERRCODE = '55006',
						  DETAIL = CASE WHEN p.token IS NOT NULL
							THEN pg_catalog.format('Attempt %s holds the key now.', p.attempt)
							ELSE 'The sweeper reset the key after its lease ended.' END,
						  HINT = 'Another attempt took the claim over, or this token never held it: do not store this attempt''s result.';
			END IF;
			-- The token is current, and another transaction holds the row.
			-- That may be another token call asking the row's locks
			-- (_row_hold takes each for an instant): ask again for a few
			-- milliseconds before refusing.
			IF row_held AND held_rounds OPERATOR(pg_catalog.<) 20 THEN
				held_rounds := held_rounds OPERATOR(pg_catalog.+) 1;
				PERFORM pg_catalog.pg_sleep(0.001);
				CONTINUE;
			END IF;
			IF row_held THEN
				RAISE EXCEPTION 'could not % idempotency key %', kind, disp
					USING ERRCODE = '55P03',
						  DETAIL = 'Another transaction holds a row lock on this key.',
						  HINT = 'Retry once that transaction has ended.';
			END IF;
			step := 'again';	-- the row changed between the two reads
		END IF;
		IF step OPERATOR(pg_catalog.=) 'wait' THEN
			-- Wait as a row lock waits, so that a deadlock is detected.  The
			-- lock is held for an instant once the wait is over, and another
			-- token call of the key may see it: FOR NO KEY UPDATE reads there
			-- as an update and is waited for in turn, where FOR SHARE would
			-- read as a plain row lock and refuse that call.
			BEGIN
				PERFORM FROM idempotency.keys k WHERE k.ctid OPERATOR(pg_catalog.=) p.tid
					FOR NO KEY UPDATE;
				-- the lock only served to wait: roll it back at once
				RAISE EXCEPTION 'waited' USING ERRCODE = 'IDW01';
			EXCEPTION WHEN SQLSTATE 'IDW01' THEN
				NULL;
			END;
		END IF;
		rounds := rounds OPERATOR(pg_catalog.+) 1;
		IF rounds OPERATOR(pg_catalog.>=) 100 THEN
			RAISE EXCEPTION 'idempotency key changed during a write'
				USING ERRCODE = '40001',
					  DETAIL = 'Someone changed idempotency.keys outside the extension''s functions.',
					  HINT = 'Retry the transaction.';
		END IF;
	END LOOP;
END;
$$;

/*
 * The arguments of a token call, checked in the C edition's order, inline
 * where they are fine: a _check_* function runs only to raise its error.
 */
CREATE OR REPLACE FUNCTION idempotency._token_call_args(fn text, p_key text,
	p_token bigint, p_scope text)
RETURNS void
LANGUAGE plpgsql IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
	PERFORM idempotency._check_name(p_key, 'key', false);
	PERFORM idempotency._check_name(p_scope, 'scope', true);
	IF p_token IS NULL THEN
		RAISE EXCEPTION 'token must not be null' USING ERRCODE = '22004';
	END IF;
END;
$$;

-- versions before 1.7.0 had no remember argument (01_update.sql)
DO $do$
BEGIN
	PERFORM idempotency._update_set_aside(
		'idempotency.idem_finish(text,bigint,integer,jsonb,text,text,interval)');
	PERFORM idempotency._update_set_aside(
		'idempotency.idem_finish_many(text[],bigint[],integer[],jsonb[],text,text,interval)');
END;
$do$;

CREATE OR REPLACE FUNCTION idempotency.idem_finish(
	key				text,
	token			bigint,
	response_code	integer		DEFAULT NULL,
	response_body	jsonb		DEFAULT NULL,
	scope			text		DEFAULT '',
	status			text		DEFAULT 'succeeded',
	retention		interval	DEFAULT NULL,
	remember		interval	DEFAULT NULL)
RETURNS timestamptz
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
	who name := idempotency._caller();
	r record;
	result timestamptz;
BEGIN
	IF key IS NULL OR token IS NULL OR scope IS NULL OR pg_catalog.octet_length(key) OPERATOR(pg_catalog.=) 0 OR
	   pg_catalog.octet_length(key) OPERATOR(pg_catalog.>) 255 OR pg_catalog.octet_length(scope) OPERATOR(pg_catalog.>) 255 THEN
		PERFORM idempotency._token_call_args('idem_finish()', key, token, scope);
	END IF;
	IF response_body IS NOT NULL AND
	   pg_catalog.pg_column_size(response_body::text::jsonb) OPERATOR(pg_catalog.-) 4 OPERATOR(pg_catalog.>) idempotency._response_limit() THEN
		PERFORM idempotency._check_body(response_body, 'response_body');
	END IF;
	IF status IS NULL OR (status OPERATOR(pg_catalog.<>) 'succeeded' AND status OPERATOR(pg_catalog.<>) 'failed') THEN
		PERFORM idempotency._check_status(status);
	END IF;
	IF retention IS NOT NULL OR remember IS NOT NULL THEN
		PERFORM idempotency._check_positive(retention, 'retention');
		PERFORM idempotency._check_interval(remember, 'remember', true);
	END IF;
	IF pg_catalog.pg_is_in_recovery() OR pg_catalog.current_setting('transaction_read_only')::boolean THEN
		PERFORM idempotency._check_writable('idem_finish()');
	END IF;
	-- The token holds the key, its row is sound, no binding of the caller
	-- refuses the scope and no code is attached to the table: the row
	-- locked and finished right here, as _token_call would.  Anything else
	-- (a refusal, a held row, attached code, a missing table) is
	-- _token_call's, which reads the key again (a row locked here stays
	-- this transaction's).  Row exclusive on the table first (see
	-- idem_claim).
	IF pg_catalog.to_regclass('idempotency.keys') IS NOT NULL AND
	   pg_catalog.to_regclass('idempotency.scope_bindings') IS NOT NULL THEN
		LOCK TABLE idempotency.keys IN ROW EXCLUSIVE MODE;
		SELECT v.verdict, k.tid, k.retention, k.sweep_at, v.now
		  INTO r
		  FROM (SELECT idempotency._store_verdict() AS verdict,
					   'idempotency.token_seq'::pg_catalog.regclass AS seq,
					   pg_catalog.clock_timestamp() AS now) v
		  LEFT JOIN LATERAL (
			SELECT k.ctid AS tid, k.retention, k.sweep_at
			  FROM idempotency.keys k
			 WHERE k.scope OPERATOR(pg_catalog.=) idem_finish.scope AND k.key OPERATOR(pg_catalog.=) idem_finish.key
			   AND k.status OPERATOR(pg_catalog.=) 'pending' AND k.token OPERATOR(pg_catalog.=) idem_finish.token
			   AND k.expires_at OPERATOR(pg_catalog.>) v.now
			   AND k.attempt IS NOT NULL AND k.created_at IS NOT NULL AND k.retention IS NOT NULL
			   AND k.sweep_at IS NOT NULL
			   AND (k.fingerprint IS NULL OR pg_catalog.octet_length(k.fingerprint) OPERATOR(pg_catalog.=) 32)
			   AND NOT EXISTS (SELECT FROM idempotency.scope_bindings sb
							   WHERE sb.role::pg_catalog.oid OPERATOR(pg_catalog.=)
									 pg_catalog.to_regrole(pg_catalog.quote_ident(who))
								 AND (sb.scope_prefix IS NULL OR
									  NOT pg_catalog.starts_with(idem_finish.scope, sb.scope_prefix)))
			   FOR NO KEY UPDATE OF k SKIP LOCKED) k ON true;
		IF r.tid IS NOT NULL AND r.verdict OPERATOR(pg_catalog.=) 0 THEN
			result := r.now OPERATOR(pg_catalog.+) COALESCE(retention, r.retention);
			UPDATE idempotency.keys k
			   SET status = idem_finish.status, response_code = idem_finish.response_code,
				   response_body = idem_finish.response_body, finished_at = r.now,
				   lease_until = NULL, expires_at = result,
				   sweep_at = LEAST(r.sweep_at, result), owner_session = NULL,
				   remember = CASE WHEN idem_finish.remember IS NULL THEN k.remember
							  ELSE NULLIF(idem_finish.remember, '0'::interval) END,
				   request = NULL
			 WHERE k.ctid OPERATOR(pg_catalog.=) r.tid;
			IF FOUND THEN
				RETURN result;
			END IF;
		END IF;
	END IF;
	RETURN (idempotency._token_call(who, pg_catalog.to_regrole(pg_catalog.quote_ident(who)), 'finish',
		key, token, scope, response_code, response_body, status, retention, NULL, remember)).result;
END;
$$;

CREATE OR REPLACE FUNCTION idempotency.idem_extend(
	key		text,
	token	bigint,
	lease	interval	DEFAULT NULL,
	scope	text		DEFAULT '')
RETURNS timestamptz
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
	who name := idempotency._caller();
BEGIN
	PERFORM idempotency._token_call_args('idem_extend()', key, token, scope);
	PERFORM idempotency._check_positive(lease, 'lease');
	PERFORM idempotency._check_writable('idem_extend()');
	RETURN (idempotency._token_call(who, pg_catalog.to_regrole(pg_catalog.quote_ident(who)), 'extend',
		key, token, scope, NULL, NULL, NULL, lease, NULL, NULL)).result;
END;
$$;

CREATE OR REPLACE FUNCTION idempotency.idem_release(
	key		text,
	token	bigint,
	scope	text	DEFAULT '')
RETURNS void
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
	who name := idempotency._caller();
BEGIN
	PERFORM idempotency._token_call_args('idem_release()', key, token, scope);
	PERFORM idempotency._check_writable('idem_release()');
	PERFORM idempotency._token_call(who, pg_catalog.to_regrole(pg_catalog.quote_ident(who)), 'release',
		key, token, scope, NULL, NULL, NULL, NULL, NULL, NULL);
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
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
	who name := idempotency._caller();
BEGIN
	PERFORM idempotency._token_call_args('idem_checkpoint()', key, token, scope);
	PERFORM idempotency._check_name(phase, 'phase', false);
	PERFORM idempotency._check_body(data, 'data');
	PERFORM idempotency._check_writable('idem_checkpoint()');
	PERFORM idempotency._token_call(who, pg_catalog.to_regrole(pg_catalog.quote_ident(who)), 'checkpoint',
		key, token, scope, NULL, data, NULL, NULL, phase, NULL);
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
	retention		interval	DEFAULT NULL,
	remember		interval	DEFAULT NULL)
RETURNS TABLE (ord integer, key text, expires_at timestamptz)
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE ROWS 100 SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
	who name := idempotency._caller();
	role oid;
	k text[];
	t bigint[];
	c integer[];
	b jsonb[];
	n integer;
	lim bigint;
	now timestamptz;
	fin_at timestamptz[];
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
		IF k[i] IS NULL OR pg_catalog.octet_length(k[i]) OPERATOR(pg_catalog.=) 0 OR
		   pg_catalog.octet_length(k[i]) OPERATOR(pg_catalog.>) 255 THEN
			PERFORM idempotency._check_name(k[i], pg_catalog.format('keys[%s]', i), false);
		END IF;
	END LOOP;
	lim := idempotency._response_limit();
	FOR i IN 1..n LOOP
		IF t[i] IS NULL THEN
			RAISE EXCEPTION 'tokens[%] must not be null', i USING ERRCODE = '22004';
		END IF;
		IF b[i] IS NOT NULL AND
		   pg_catalog.pg_column_size(b[i]::text::jsonb) OPERATOR(pg_catalog.-) 4 OPERATOR(pg_catalog.>) lim THEN
			PERFORM idempotency._check_body(b[i], pg_catalog.format('response_bodies[%s]', i));
		END IF;
	END LOOP;
	PERFORM idempotency._check_name(scope, 'scope', true);
	PERFORM idempotency._check_status(status);
	PERFORM idempotency._check_positive(retention, 'retention');
	PERFORM idempotency._check_interval(remember, 'remember', true);
	PERFORM idempotency._check_writable('idem_finish_many()');
	role := pg_catalog.to_regrole(pg_catalog.quote_ident(who));
	-- Row exclusive on the table before the store's verdict is read (see
	-- idem_claim).
	IF pg_catalog.to_regclass('idempotency.keys') IS NOT NULL AND
	   pg_catalog.to_regclass('idempotency.scope_bindings') IS NOT NULL THEN
		LOCK TABLE idempotency.keys IN ROW EXCLUSIVE MODE;
	END IF;
	-- One block for the whole batch (a block per element would open a
	-- subtransaction per key): the element that fails is in ord and key.
	BEGIN
		-- The whole batch in one statement, in read committed, when no code
		-- is attached to the table, no binding of the caller refuses the
		-- scope and the keys are distinct: every row the token holds,
		-- sound, locked without waiting and finished as _token_call
		-- finishes one.  All or nothing: when it cannot finish every
		-- element, the inner block's subtransaction takes back what it did
		-- (so that no row stays locked out of order) and every element is
		-- finished or refused one by one below, in order, by _token_call.
		-- An error here (the store's verdict) is the first element's, as
		-- its own call would raise it.
		ord := 1;
		key := k[1];
		IF n OPERATOR(pg_catalog.>) 0 AND
		   pg_catalog.current_setting('transaction_isolation') OPERATOR(pg_catalog.=) 'read committed' AND
		   pg_catalog.to_regclass('idempotency.keys') IS NOT NULL AND
		   pg_catalog.to_regclass('idempotency.scope_bindings') IS NOT NULL AND
		   (SELECT v.verdict OPERATOR(pg_catalog.=) 0 AND
				   NOT EXISTS (SELECT FROM idempotency.scope_bindings sb
							   WHERE sb.role::pg_catalog.oid OPERATOR(pg_catalog.=) pg_catalog.to_regrole(pg_catalog.quote_ident(who))
								 AND (sb.scope_prefix IS NULL OR
									  NOT pg_catalog.starts_with(idem_finish_many.scope, sb.scope_prefix))) AND
				   (SELECT pg_catalog.count(DISTINCT u) FROM pg_catalog.unnest(k) u) OPERATOR(pg_catalog.=) n
			  FROM (SELECT idempotency._store_verdict() AS verdict,
						   'idempotency.token_seq'::pg_catalog.regclass AS seq) v
			  LEFT JOIN idempotency.keys kk ON false) THEN
			BEGIN
				now := pg_catalog.clock_timestamp();
				-- each element's row looked up by its key (a lateral lookup,
				-- so that no plan made for a table without statistics scans
				-- it once per element)
				WITH held AS (
					SELECT u.i, kk.tid, u.code, u.body,
						   now OPERATOR(pg_catalog.+) COALESCE(idem_finish_many.retention, kk.retention) AS expires
					  FROM ROWS FROM (pg_catalog.unnest(k), pg_catalog.unnest(t), pg_catalog.unnest(c),
									  pg_catalog.unnest(b)) WITH ORDINALITY u(key, token, code, body, i)
					  CROSS JOIN LATERAL (
						SELECT kk.ctid AS tid, kk.retention
						  FROM idempotency.keys kk
						 WHERE kk.scope OPERATOR(pg_catalog.=) idem_finish_many.scope
						   AND kk.key OPERATOR(pg_catalog.=) u.key
						   AND kk.status OPERATOR(pg_catalog.=) 'pending' AND kk.token OPERATOR(pg_catalog.=) u.token
						   AND kk.expires_at OPERATOR(pg_catalog.>) now
						   AND kk.attempt IS NOT NULL AND kk.created_at IS NOT NULL AND kk.retention IS NOT NULL
						   AND kk.sweep_at IS NOT NULL
						   AND (kk.fingerprint IS NULL OR pg_catalog.octet_length(kk.fingerprint) OPERATOR(pg_catalog.=) 32)
						   FOR NO KEY UPDATE OF kk SKIP LOCKED) kk),
				done AS (
					UPDATE idempotency.keys kk
					   SET status = idem_finish_many.status, response_code = held.code,
						   response_body = held.body, finished_at = now,
						   lease_until = NULL, expires_at = held.expires,
						   sweep_at = LEAST(kk.sweep_at, held.expires), owner_session = NULL,
						   remember = CASE WHEN idem_finish_many.remember IS NULL THEN kk.remember
									  ELSE NULLIF(idem_finish_many.remember, '0'::interval) END,
						   request = NULL
					  FROM held
					 WHERE kk.ctid OPERATOR(pg_catalog.=) ANY (ARRAY(SELECT h.tid FROM held h))
					   AND kk.ctid OPERATOR(pg_catalog.=) held.tid
					RETURNING held.i, held.expires)
				SELECT pg_catalog.array_agg(done.expires ORDER BY done.i)
				  INTO fin_at
				  FROM done;
				IF pg_catalog.cardinality(fin_at) IS DISTINCT FROM n THEN
					RAISE EXCEPTION 'not every element' USING ERRCODE = 'IDB01';
				END IF;
			EXCEPTION WHEN SQLSTATE 'IDB01' THEN
				fin_at := NULL;
			END;
			IF fin_at IS NOT NULL THEN
				RETURN QUERY SELECT u.i::integer, u.key, u.expires
				  FROM ROWS FROM (pg_catalog.unnest(k), pg_catalog.unnest(fin_at))
					   WITH ORDINALITY u(key, expires, i);
				RETURN;
			END IF;
		END IF;
		FOR i IN 1..n LOOP
			ord := i;
			key := k[i];
			expires_at := (idempotency._token_call(who, role, 'finish', k[i], t[i], scope,
				c[i], b[i], status, retention, NULL, remember)).result;
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

-- versions before 1.7.0 had no remembered_until column (01_update.sql)
DO $do$
BEGIN
	PERFORM idempotency._update_set_aside('idempotency.idem_lookup(text,text)', 'remembered_until');
END;
$do$;

CREATE OR REPLACE FUNCTION idempotency.idem_lookup(
	key		text,
	scope	text	DEFAULT '')
RETURNS TABLE (status text, attempt integer, response_code integer,
			   response_body jsonb, created_at timestamptz,
			   finished_at timestamptz, expires_at timestamptz,
			   phase text, remembered_until timestamptz)
LANGUAGE plpgsql STABLE PARALLEL RESTRICTED ROWS 1 SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
	who name := idempotency._caller();
	r record;
	now timestamptz;
	past boolean;
BEGIN
	IF key IS NULL OR scope IS NULL OR pg_catalog.octet_length(key) OPERATOR(pg_catalog.=) 0 OR
	   pg_catalog.octet_length(key) OPERATOR(pg_catalog.>) 255 OR pg_catalog.octet_length(scope) OPERATOR(pg_catalog.>) 255 THEN
		PERFORM idempotency._check_name(key, 'key', false);
		PERFORM idempotency._check_name(scope, 'scope', true);
	END IF;
	IF pg_catalog.to_regclass('idempotency.keys') IS NULL OR
	   pg_catalog.to_regclass('idempotency.scope_bindings') IS NULL THEN
		PERFORM idempotency._check_store();
	END IF;
	SELECT v.verdict, b.role IS NOT NULL AS bound, b.scope_prefix AS prefix,
		   k.ctid IS NOT NULL AS present, k.status, k.attempt, k.response_code,
		   k.response_body, k.created_at, k.finished_at, k.expires_at, k.phase,
		   k.retention, k.sweep_at, k.fingerprint, k.remember
	  INTO r
	  FROM (SELECT idempotency._store_verdict() AS verdict,
				   'idempotency.token_seq'::pg_catalog.regclass AS seq) v
	  LEFT JOIN idempotency.scope_bindings b
		ON b.role::pg_catalog.oid OPERATOR(pg_catalog.=) pg_catalog.to_regrole(pg_catalog.quote_ident(who))
	  LEFT JOIN idempotency.keys k
		ON k.scope OPERATOR(pg_catalog.=) idem_lookup.scope AND k.key OPERATOR(pg_catalog.=) idem_lookup.key;
	IF r.bound AND (r.prefix IS NULL OR NOT pg_catalog.starts_with(scope, r.prefix)) THEN
		PERFORM idempotency._tenant_refuse(who, scope, r.prefix);
	END IF;
	IF NOT r.present THEN
		RETURN;
	END IF;
	IF r.status IS NULL OR r.attempt IS NULL OR r.created_at IS NULL OR
	   r.expires_at IS NULL OR r.retention IS NULL OR r.sweep_at IS NULL OR
	   r.status OPERATOR(pg_catalog.<>) ALL (ARRAY['pending', 'succeeded', 'failed']) OR
	   pg_catalog.octet_length(r.fingerprint) OPERATOR(pg_catalog.<>) 32 THEN
		PERFORM idempotency._check_row(scope, key, r.status, r.attempt,
			r.created_at, r.expires_at, r.retention, r.sweep_at, r.fingerprint);
	END IF;
	now := pg_catalog.clock_timestamp();
	past := r.expires_at OPERATOR(pg_catalog.<=) now;
	IF past AND NOT idempotency._remembered(r.status, r.expires_at, r.remember, now) THEN
		RETURN;
	END IF;
	status := r.status; attempt := r.attempt; response_code := r.response_code;
	created_at := r.created_at; finished_at := r.finished_at; expires_at := r.expires_at;
	-- a remembered key's response is gone, compacted or not yet
	IF NOT past THEN
		response_body := r.response_body; phase := r.phase;
	END IF;
	IF r.status OPERATOR(pg_catalog.<>) 'pending' THEN
		remembered_until := r.expires_at OPERATOR(pg_catalog.+) r.remember;
	END IF;
	RETURN NEXT;
END;
$$;

/* ---------------------------------------------------------------------
 * Forgetting a key (forget.c)
 * ---------------------------------------------------------------------
 */

/*
 * True when a finished or remembered key was deleted, false when there was
 * none (absent, or past its retention and not remembered).  A key another
 * transaction is inserting is seen by its lane (key_lanes), which that
 * transaction holds: asked without waiting, in a subtransaction rolled
 * back at once, so that nothing stays locked.
 */
CREATE OR REPLACE FUNCTION idempotency.idem_forget(
	key		text,
	scope	text	DEFAULT '')
RETURNS boolean
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
	who name := idempotency._caller();
	disp text;
	r record;
	p record;
	l record;
	now timestamptz;
	saved jsonb;
	n bigint;
BEGIN
	PERFORM idempotency._check_name(key, 'key', false);
	PERFORM idempotency._check_name(scope, 'scope', true);
	PERFORM idempotency._check_writable('idem_forget()');
	IF pg_catalog.to_regclass('idempotency.keys') IS NULL OR
	   pg_catalog.to_regclass('idempotency.scope_bindings') IS NULL THEN
		PERFORM idempotency._check_store();
	END IF;
	-- Row exclusive on the table before the store's verdict is read (see
	-- idem_claim).
	LOCK TABLE idempotency.keys IN ROW EXCLUSIVE MODE;
	SELECT v.verdict, b.role IS NOT NULL AS bound, b.scope_prefix AS prefix
	  INTO r
	  FROM (SELECT idempotency._store_verdict() AS verdict,
				   'idempotency.token_seq'::pg_catalog.regclass AS seq) v
	  LEFT JOIN idempotency.scope_bindings b
		ON b.role::pg_catalog.oid OPERATOR(pg_catalog.=) pg_catalog.to_regrole(pg_catalog.quote_ident(who))
	  LEFT JOIN idempotency.keys k ON false;
	IF r.bound AND (r.prefix IS NULL OR NOT pg_catalog.starts_with(scope, r.prefix)) THEN
		PERFORM idempotency._tenant_refuse(who, scope, r.prefix);
	END IF;
	disp := idempotency._key_display(scope, key);
	FOR round IN 1..100 LOOP
		SELECT * INTO p FROM idempotency._probe(scope, key);
		IF NOT p.busy AND NOT p.present THEN
			BEGIN
				PERFORM FROM idempotency.key_lanes kl
				 WHERE kl.lane OPERATOR(pg_catalog.=) idempotency._key_lane(scope, key)
				   FOR SHARE SKIP LOCKED;
				p.busy := NOT FOUND;
				RAISE EXCEPTION 'asked' USING ERRCODE = 'IDW02';
			EXCEPTION WHEN SQLSTATE 'IDW02' THEN
				NULL;
			END;
		END IF;
		IF p.busy THEN
			RAISE EXCEPTION 'could not forget idempotency key %', disp
				USING ERRCODE = '55P03',
					  DETAIL = 'Another transaction is changing or locking it right now.',
					  HINT = 'Try again once that transaction ends.';
		END IF;
		now := pg_catalog.clock_timestamp();
		IF NOT p.present OR (p.expires_at OPERATOR(pg_catalog.<=) now AND
			NOT idempotency._remembered(p.status, p.expires_at, p.remember, now)) THEN
			RETURN false;
		END IF;
		IF p.status OPERATOR(pg_catalog.=) 'pending' THEN
			RAISE EXCEPTION 'idempotency key % is pending', disp
				USING ERRCODE = '55000',
					  DETAIL = 'Its attempt may still be running; only a finished key can be forgotten.',
					  HINT = 'Release it with its token, or claim it once its lease has ended.';
		END IF;
		-- the newest committed version, locked without waiting; a version
		-- changed since the probe is read again
		SELECT k.ctid AS tid INTO l
		  FROM idempotency.keys k
		 WHERE k.scope OPERATOR(pg_catalog.=) idem_forget.scope AND k.key OPERATOR(pg_catalog.=) idem_forget.key
		   AND k.ctid OPERATOR(pg_catalog.=) p.tid
		   FOR UPDATE SKIP LOCKED;
		IF FOUND THEN
			r.verdict := idempotency._write_verdict();
			IF r.verdict OPERATOR(pg_catalog.<>) 0 THEN
				PERFORM idempotency._refuse_write(r.verdict);
				saved := idempotency._settings_save();
			END IF;
			DELETE FROM idempotency.keys k WHERE k.ctid OPERATOR(pg_catalog.=) l.tid;
			GET DIAGNOSTICS n = ROW_COUNT;
			IF saved IS NOT NULL THEN
				PERFORM idempotency._settings_restore(saved);
			END IF;
			RETURN n OPERATOR(pg_catalog.>) 0;
		END IF;
	END LOOP;
	RAISE EXCEPTION 'idempotency key changed during a write'
		USING ERRCODE = '40001',
			  DETAIL = 'Someone changed idempotency.keys outside the extension''s functions.',
			  HINT = 'Retry the transaction.';
END;
$$;

REVOKE ALL ON FUNCTION idempotency.idem_forget(text, text) FROM PUBLIC;

/* ---------------------------------------------------------------------
 * Sweeping (sweep.c)
 * ---------------------------------------------------------------------
 */

/*
 * Sweep the row versions "tids" (candidates locked by the caller): delete
 * those past their retention whose attempt does not run, but compact a
 * remembered one (its response, recovery point and any kept request go,
 * its outcome and fingerprint stay, sweep_at moves to its remember's end,
 * which also marks it compacted), reset pending ones whose attempt ended
 * (their tokens die; a kept request stays for a completer), at most
 * "max_expire" deleted or compacted and "max_reset" reset; with
 * "reschedule", move the others' sweep_at to when they next need a look.
 * Each scope with a key reset is notified on idempotency_abandoned; keys
 * deleted or compacted notify nothing.  A pending key our own open
 * transaction claimed is left alone.  Nothing is written where the store's verdict refuses a write
 * (_refuse_write), and nothing is refused when there is nothing to write.
 * Returns how many were expired (deleted or compacted: either ends a
 * key's stored response), reset and rescheduled.
 */
CREATE OR REPLACE FUNCTION idempotency._sweep_rows(tids tid[], now timestamptz,
	max_expire bigint, max_reset bigint, reschedule boolean, verdict integer,
	OUT expired bigint, OUT reset bigint, OUT rescheduled bigint)
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
	c record;
	runs boolean;
	own boolean := pg_catalog.pg_current_xact_id_if_assigned() IS NOT NULL;
	snap pg_snapshot;
	x8 xid8;
	del tid[] := '{}';
	comp tid[] := '{}';
	res tid[] := '{}';
	later tid[] := '{}';
	res_scopes text[] := '{}';
	t tid;
	n bigint;
	saved jsonb;
BEGIN
	expired := 0;
	reset := 0;
	rescheduled := 0;
	IF own THEN
		snap := pg_catalog.pg_current_snapshot();
	END IF;
	FOR c IN
		SELECT k.ctid AS tid, k.xmin AS xmin_, k.scope, k.status, k.token, k.lease_until,
			   k.expires_at, k.owner_session, k.sweep_at, k.remember
		  FROM idempotency.keys k
		 WHERE k.ctid OPERATOR(pg_catalog.=) ANY (tids)
	LOOP
		IF own AND c.status OPERATOR(pg_catalog.=) 'pending' THEN
			-- a version a running transaction wrote and we see is ours
			x8 := idempotency._xid8(c.xmin_, snap);
			CONTINUE WHEN x8 IS NOT NULL AND
				pg_catalog.pg_xact_status(x8) OPERATOR(pg_catalog.=) 'in progress';
		END IF;
		runs := c.status OPERATOR(pg_catalog.=) 'pending' AND c.token IS NOT NULL AND
			c.lease_until OPERATOR(pg_catalog.>) now AND
			(c.owner_session IS NULL OR idempotency._session_alive(c.owner_session));
		IF c.expires_at OPERATOR(pg_catalog.<=) now AND NOT runs THEN
			IF expired OPERATOR(pg_catalog.>=) max_expire THEN
				CONTINUE;
			ELSIF NOT idempotency._remembered(c.status, c.expires_at, c.remember, now) THEN
				del := del OPERATOR(pg_catalog.||) c.tid;
				expired := expired OPERATOR(pg_catalog.+) 1;
			ELSIF c.sweep_at OPERATOR(pg_catalog.>) c.expires_at THEN
				-- compacted already, when its retention passed
				IF reschedule THEN
					later := later OPERATOR(pg_catalog.||) c.tid;
				END IF;
			ELSE
				comp := comp OPERATOR(pg_catalog.||) c.tid;
				expired := expired OPERATOR(pg_catalog.+) 1;
			END IF;
		ELSIF c.status OPERATOR(pg_catalog.=) 'pending' AND c.token IS NOT NULL AND NOT runs THEN
			IF reset OPERATOR(pg_catalog.<) max_reset THEN
				res := res OPERATOR(pg_catalog.||) c.tid;
				res_scopes := pg_catalog.array_append(res_scopes, c.scope);
				reset := reset OPERATOR(pg_catalog.+) 1;
			END IF;
		ELSIF reschedule THEN
			later := later OPERATOR(pg_catalog.||) c.tid;
		END IF;
	END LOOP;
	IF verdict OPERATOR(pg_catalog.<>) 0 AND pg_catalog.cardinality(del) OPERATOR(pg_catalog.+)
	   pg_catalog.cardinality(comp) OPERATOR(pg_catalog.+) pg_catalog.cardinality(res)
	   OPERATOR(pg_catalog.+) pg_catalog.cardinality(later) OPERATOR(pg_catalog.>) 0 THEN
		PERFORM idempotency._refuse_write(verdict);
	END IF;
	-- A row a trigger or rule keeps from being written (a BEFORE trigger
	-- that returns NULL) is not counted.  Where the table runs a user's
	-- code, each row is written alone, its settings set back after it
	-- (_settings_restore), so that no row's trigger runs with what an
	-- earlier row's changed.
	IF verdict OPERATOR(pg_catalog.&) 1 OPERATOR(pg_catalog.<>) 0 THEN
		expired := 0;
		reset := 0;
		rescheduled := 0;
		FOREACH t IN ARRAY del LOOP
			saved := idempotency._settings_save();
			DELETE FROM idempotency.keys k WHERE k.ctid OPERATOR(pg_catalog.=) t;
			GET DIAGNOSTICS n = ROW_COUNT;
			expired := expired OPERATOR(pg_catalog.+) n;
			PERFORM idempotency._settings_restore(saved);
		END LOOP;
		FOREACH t IN ARRAY comp LOOP
			saved := idempotency._settings_save();
			UPDATE idempotency.keys k
			   SET response_body = NULL, phase = NULL, phase_data = NULL, request = NULL,
				   sweep_at = k.expires_at OPERATOR(pg_catalog.+) k.remember
			 WHERE k.ctid OPERATOR(pg_catalog.=) t;
			GET DIAGNOSTICS n = ROW_COUNT;
			expired := expired OPERATOR(pg_catalog.+) n;
			PERFORM idempotency._settings_restore(saved);
		END LOOP;
		FOR i IN 1..pg_catalog.cardinality(res) LOOP
			saved := idempotency._settings_save();
			UPDATE idempotency.keys k
			   SET token = NULL, sweep_at = k.expires_at, owner_session = NULL
			 WHERE k.ctid OPERATOR(pg_catalog.=) res[i];
			GET DIAGNOSTICS n = ROW_COUNT;
			reset := reset OPERATOR(pg_catalog.+) n;
			PERFORM idempotency._settings_restore(saved);
			IF n OPERATOR(pg_catalog.>) 0 THEN
				PERFORM pg_catalog.pg_notify('idempotency_abandoned', res_scopes[i]);
			END IF;
		END LOOP;
		FOREACH t IN ARRAY later LOOP
			saved := idempotency._settings_save();
			UPDATE idempotency.keys k
			   SET sweep_at = CASE WHEN k.status OPERATOR(pg_catalog.=) 'pending' AND k.token IS NOT NULL
									AND k.lease_until OPERATOR(pg_catalog.>) now
								   THEN k.lease_until
								   WHEN idempotency._remembered(k.status, k.expires_at, k.remember, now)
								   THEN k.expires_at OPERATOR(pg_catalog.+) k.remember
								   ELSE k.expires_at END
			 WHERE k.ctid OPERATOR(pg_catalog.=) t;
			GET DIAGNOSTICS n = ROW_COUNT;
			rescheduled := rescheduled OPERATOR(pg_catalog.+) n;
			PERFORM idempotency._settings_restore(saved);
		END LOOP;
		RETURN;
	END IF;
	expired := 0;
	IF pg_catalog.cardinality(del) OPERATOR(pg_catalog.>) 0 THEN
		DELETE FROM idempotency.keys k WHERE k.ctid OPERATOR(pg_catalog.=) ANY (del);
		GET DIAGNOSTICS expired = ROW_COUNT;
	END IF;
	IF pg_catalog.cardinality(comp) OPERATOR(pg_catalog.>) 0 THEN
		UPDATE idempotency.keys k
		   SET response_body = NULL, phase = NULL, phase_data = NULL, request = NULL,
			   sweep_at = k.expires_at OPERATOR(pg_catalog.+) k.remember
		 WHERE k.ctid OPERATOR(pg_catalog.=) ANY (comp);
		GET DIAGNOSTICS n = ROW_COUNT;
		expired := expired OPERATOR(pg_catalog.+) n;
	END IF;
	IF pg_catalog.cardinality(res) OPERATOR(pg_catalog.>) 0 THEN
		WITH done AS (
			UPDATE idempotency.keys k
			   SET token = NULL, sweep_at = k.expires_at, owner_session = NULL
			 WHERE k.ctid OPERATOR(pg_catalog.=) ANY (res)
			RETURNING k.scope)
		SELECT pg_catalog.count(*), pg_catalog.array_agg(DISTINCT done.scope)
		  INTO reset, res_scopes
		  FROM done;
		PERFORM pg_catalog.pg_notify('idempotency_abandoned', u.scope)
		   FROM pg_catalog.unnest(res_scopes) u(scope);
	END IF;
	-- (a pending key in "later" whose lease runs has a live owner: a dead
	-- one's key was reset above)
	IF pg_catalog.cardinality(later) OPERATOR(pg_catalog.>) 0 THEN
		UPDATE idempotency.keys k
		   SET sweep_at = CASE WHEN k.status OPERATOR(pg_catalog.=) 'pending' AND k.token IS NOT NULL
								AND k.lease_until OPERATOR(pg_catalog.>) now
							   THEN k.lease_until
							   WHEN idempotency._remembered(k.status, k.expires_at, k.remember, now)
							   THEN k.expires_at OPERATOR(pg_catalog.+) k.remember
							   ELSE k.expires_at END
		 WHERE k.ctid OPERATOR(pg_catalog.=) ANY (later);
		GET DIAGNOSTICS rescheduled = ROW_COUNT;
	END IF;
END;
$$;

/*
 * Delete keys past their retention (compact the remembered ones) and reset
 * pending keys whose lease ended (or whose session ended), at most
 * batch_size of each kind; keys found before their time are rescheduled on
 * the way.  Never waits: rows
 * that others are changing or locking are skipped (FOR NO KEY UPDATE SKIP
 * LOCKED, which also reads the newest committed version of each).  Sends
 * NOTIFY idempotency_abandoned once for each scope where it reset a key,
 * delivered when the caller's transaction commits.
 */
CREATE OR REPLACE FUNCTION idempotency.idem_sweep(
	batch_size	integer	DEFAULT NULL)
RETURNS TABLE (expired bigint, reset bigint)
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE ROWS 1 SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
	batch bigint;
	now timestamptz;
	verdict integer;
	tids tid[];
	w record;
	n bigint;
	owners bigint[];
	dead bigint[];
BEGIN
	IF batch_size IS NOT NULL AND batch_size OPERATOR(pg_catalog.<=) 0 THEN
		RAISE EXCEPTION 'batch_size must be positive' USING ERRCODE = '22023';
	END IF;
	batch := COALESCE(batch_size,
		idempotency._guc_bytes('idempotency.sweep_batch', 1000)::integer);
	PERFORM idempotency._check_writable('idem_sweep()');
	-- row exclusive on the table first, so that the verdict below is the
	-- table's as it is (see idem_claim)
	IF pg_catalog.to_regclass('idempotency.keys') IS NOT NULL THEN
		LOCK TABLE idempotency.keys IN ROW EXCLUSIVE MODE;
	END IF;
	-- the store's verdict, cached in this query's plan (see _store_verdict)
	SELECT v.verdict INTO verdict
	  FROM (SELECT idempotency._store_verdict() AS verdict,
				   'idempotency.token_seq'::pg_catalog.regclass AS seq) v
	  LEFT JOIN idempotency.keys k ON false;
	now := pg_catalog.clock_timestamp();
	expired := 0;
	reset := 0;
	LOOP
		n := LEAST(batch OPERATOR(pg_catalog.*) 2, 2147483647);
		tids := ARRAY(SELECT k.ctid FROM idempotency.keys k
					   WHERE k.sweep_at OPERATOR(pg_catalog.<=) now
					   ORDER BY k.sweep_at
					   LIMIT n
					   FOR NO KEY UPDATE SKIP LOCKED);
		w := idempotency._sweep_rows(tids, now, batch OPERATOR(pg_catalog.-) expired,
			batch OPERATOR(pg_catalog.-) reset, true, verdict);
		expired := expired OPERATOR(pg_catalog.+) w.expired;
		reset := reset OPERATOR(pg_catalog.+) w.reset;
		EXIT WHEN pg_catalog.cardinality(tids) OPERATOR(pg_catalog.<) n
			OR w.expired OPERATOR(pg_catalog.+) w.reset OPERATOR(pg_catalog.+) w.rescheduled OPERATOR(pg_catalog.=) 0
			OR expired OPERATOR(pg_catalog.>=) batch OR reset OPERATOR(pg_catalog.>=) batch;
	END LOOP;
	-- the keys of sessions that ended: found through keys_owner_session_idx
	IF expired OPERATOR(pg_catalog.<) batch AND reset OPERATOR(pg_catalog.<) batch THEN
		owners := ARRAY(SELECT DISTINCT k.owner_session FROM idempotency.keys k
						 WHERE k.owner_session IS NOT NULL);
		dead := ARRAY(SELECT o FROM pg_catalog.unnest(owners) o
					   WHERE NOT idempotency._session_alive(o));
		IF pg_catalog.cardinality(dead) OPERATOR(pg_catalog.>) 0 THEN
			tids := ARRAY(SELECT k.ctid FROM idempotency.keys k
						   WHERE k.owner_session OPERATOR(pg_catalog.=) ANY (dead)
						   FOR NO KEY UPDATE SKIP LOCKED);
			w := idempotency._sweep_rows(tids, now, batch OPERATOR(pg_catalog.-) expired,
				batch OPERATOR(pg_catalog.-) reset, false, verdict);
			expired := expired OPERATOR(pg_catalog.+) w.expired;
			reset := reset OPERATOR(pg_catalog.+) w.reset;
		END IF;
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
RETURN '1.8.1';

/* ---------------------------------------------------------------------
 * Statistics (stats.c)
 * ---------------------------------------------------------------------
 */

-- versions before 1.8.0 had no abandoned_takeovers column (01_update.sql)
DO $do$
BEGIN
	PERFORM idempotency._update_set_aside('idempotency.stats_counters()', 'abandoned_takeovers');
END;
$do$;

/*
 * The call counters live in the C edition's shared memory; the SQL edition
 * has none, so this returns no row and the view's counters are NULL.
 */
CREATE OR REPLACE FUNCTION idempotency.stats_counters(
	OUT dbid oid, OUT claims bigint, OUT takeovers bigint, OUT replays bigint,
	OUT in_progress bigint, OUT mismatches bigint, OUT finishes bigint,
	OUT releases bigint, OUT expired bigint, OUT reset bigint,
	OUT last_sweep_at timestamptz, OUT last_sweep_ms double precision,
	OUT checkpoints bigint, OUT abandoned_takeovers bigint)
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

-- versions before 1.7.0 had no remembered column (01_update.sql)
DO $do$
BEGIN
	PERFORM idempotency._update_set_aside('idempotency.stats_key_counts()', 'remembered');
END;
$do$;

/*
 * This database's live keys by status, and its remembered keys: counted
 * exactly while the table is small (idempotency.stats_exact_limit blocks,
 * 1024 unless set; -1 always), estimated from the planner's statistics
 * above.  The estimate counts the share of rows whose expires_at the
 * histogram of ANALYZE puts before now as remembered (on a swept table
 * they are), and splits the rest by each status's share among the most
 * common values.  Only for a role that may read the stats view.
 */
CREATE OR REPLACE FUNCTION idempotency.stats_key_counts(
	OUT pending bigint, OUT succeeded bigint, OUT failed bigint,
	OUT exact boolean, OUT remembered bigint)
RETURNS record
LANGUAGE plpgsql VOLATILE PARALLEL SAFE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
	caller name := idempotency._caller();
	lim bigint := idempotency._guc_bytes('idempotency.stats_exact_limit', 1024, true, true);
	blocks bigint;
	tuples double precision;
	pages double precision;
	s record;
	now timestamptz := pg_catalog.clock_timestamp();
	bounds timestamptz[];
	below integer := 0;
	past double precision := 0;
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
		SELECT pg_catalog.count(*) FILTER (WHERE k.status OPERATOR(pg_catalog.=) 'pending'
												AND k.expires_at OPERATOR(pg_catalog.>) now),
			   pg_catalog.count(*) FILTER (WHERE k.status OPERATOR(pg_catalog.=) 'succeeded'
												AND k.expires_at OPERATOR(pg_catalog.>) now),
			   pg_catalog.count(*) FILTER (WHERE k.status OPERATOR(pg_catalog.=) 'failed'
												AND k.expires_at OPERATOR(pg_catalog.>) now),
			   pg_catalog.count(*) FILTER (WHERE k.status OPERATOR(pg_catalog.=) ANY (ARRAY['succeeded', 'failed'])
												AND idempotency._remembered(k.status, k.expires_at, k.remember, now))
		  INTO pending, succeeded, failed, remembered
		  FROM idempotency.keys k;
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
	-- the histogram's bounds split the non-null rows into equal parts
	SELECT st.histogram_bounds::text::timestamptz[] INTO bounds
	  FROM pg_catalog.pg_stats st
	 WHERE st.schemaname OPERATOR(pg_catalog.=) 'idempotency'
	   AND st.tablename OPERATOR(pg_catalog.=) 'keys'
	   AND st.attname OPERATOR(pg_catalog.=) 'expires_at' AND NOT st.inherited;
	IF pg_catalog.cardinality(bounds) OPERATOR(pg_catalog.>) 0 THEN
		WHILE below OPERATOR(pg_catalog.<) pg_catalog.cardinality(bounds) AND
			  bounds[below OPERATOR(pg_catalog.+) 1] OPERATOR(pg_catalog.<=) now LOOP
			below := below OPERATOR(pg_catalog.+) 1;
		END LOOP;
		IF pg_catalog.cardinality(bounds) OPERATOR(pg_catalog.>) 1 THEN
			past := GREATEST(below OPERATOR(pg_catalog.-) 1, 0)::double precision OPERATOR(pg_catalog./)
				(pg_catalog.cardinality(bounds) OPERATOR(pg_catalog.-) 1);
		END IF;
		IF below OPERATOR(pg_catalog.=) pg_catalog.cardinality(bounds) THEN
			past := 1;
		END IF;
	END IF;
	remembered := pg_catalog.round(tuples OPERATOR(pg_catalog.*) past);
	tuples := tuples OPERATOR(pg_catalog.-) (tuples OPERATOR(pg_catalog.*) past);
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
	OR c.dbid IS NOT NULL;

GRANT SELECT ON idempotency.stats TO PUBLIC;

/* ---------------------------------------------------------------------
 * Tenant bindings (tenant.c): the table's API
 * ---------------------------------------------------------------------
 */

/*
 * The C edition's trigger tells every backend to reload its cached
 * bindings; the SQL edition reads the binding in each call, so there is
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

-- versions before 1.7.0 had no remembered column, before 1.8.0 no
-- abandoned_takeovers (01_update.sql)
DO $do$
BEGIN
	PERFORM idempotency._update_set_aside('idempotency.cluster_stats_rows()', 'abandoned_takeovers');
END;
$do$;

/* This server's row of the stats view (the SQL edition runs without Citus). */
CREATE OR REPLACE FUNCTION idempotency.cluster_stats_rows()
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

/*
 * The API functions that the parts created anew take over the owner and
 * privileges of the older versions' they replace, which go; the update's
 * helpers are needed only while the script runs.
 */
DO $do$
BEGIN
	PERFORM idempotency._update_take_over();
END;
$do$;
DROP FUNCTION idempotency._update_set_aside(text, text);
DROP FUNCTION idempotency._update_take_over();

/*
 * Versions up to 1.6.4 had owner-rights workers that PUBLIC could call
 * with any role name, serialised keys on advisory locks a caller could
 * take, and checked tenants in a helper of their own: an update drops all
 * of them, whatever their arguments.
 */
DO $do$
DECLARE
	f regprocedure;
BEGIN
	FOR f IN
		SELECT p.oid::regprocedure FROM pg_catalog.pg_proc p
		 WHERE p.pronamespace OPERATOR(pg_catalog.=) 'idempotency'::regnamespace
		   AND (p.proname OPERATOR(pg_catalog.=) ANY (ARRAY['_w_claim', '_w_token_call',
				'_w_lookup', '_w_stats_key_counts', '_lock_class', '_key_hash',
				'_mark_insert', '_tenant_check', '_write_claim', '_held_here',
				'_sweep_one']::name[])
				OR p.oid OPERATOR(pg_catalog.=) pg_catalog.to_regprocedure('idempotency._flush_tokens()'))
	LOOP
		EXECUTE pg_catalog.format('DROP FUNCTION %s', f);
	END LOOP;
END;
$do$;

/*
 * No helper is executable by PUBLIC.  The owner runs them inside the API
 * functions; nobody else needs to.
 */
DO $do$
DECLARE
	f regprocedure;
BEGIN
	FOR f IN
		SELECT p.oid::regprocedure FROM pg_catalog.pg_proc p
		 WHERE p.pronamespace OPERATOR(pg_catalog.=) 'idempotency'::regnamespace
		   AND pg_catalog.starts_with(p.proname::text, '_')
	LOOP
		EXECUTE pg_catalog.format('REVOKE ALL ON FUNCTION %s FROM PUBLIC', f);
	END LOOP;
END;
$do$;
