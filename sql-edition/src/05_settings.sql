/*-------------------------------------------------------------------------
 *
 * 05_settings.sql
 *	  Settings, argument checks, messages and fingerprints.
 *
 * Mirrors guc.c (_guc_interval, _guc_bytes, _remember_setting: the
 * idempotency.* settings, which are placeholders without the C library,
 * with the C edition's defaults and units), args.c (the _check_* functions: every argument
 * check with the C edition's message and SQLSTATE, in the same order),
 * fingerprint.c (_fingerprint: the request's SHA-256, the same bytes as
 * the C edition's, so that a key claimed by one edition is recognised by
 * the other), and the message helpers (_raise, _key_display).  The API
 * functions test their arguments inline and call a _check_* function only
 * to raise its exact error, so these are off the fast path.  Nothing here
 * reads idempotency.keys.
 *
 *-------------------------------------------------------------------------
 */

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
