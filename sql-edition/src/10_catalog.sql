/*-------------------------------------------------------------------------
 *
 * 10_catalog.sql
 *	  Refusing a store that is not as the script made it.
 *
 * Mirrors catalog.c: _check_catalog and _check_bindings raise 55000 or
 * 42704 for a missing, replaced or damaged table, sequence or index.  The
 * SQL edition has no relation cache to remember a verdict in, so every
 * worker asks again at every call.
 *
 *-------------------------------------------------------------------------
 */

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
