/*-------------------------------------------------------------------------
 *
 * 10_catalog.sql
 *	  Refusing a store that is not as the script made it.
 *
 * Mirrors catalog.c: _check_catalog and _check_bindings raise 55000 or
 * 42704 for a missing, replaced or damaged table, sequence or index, and
 * _store_verdict adds what the C edition judges of a write (code a user
 * attached to the table, a deferrable trigger, an index that inlines a
 * SQL function).  The verdict is kept where PostgreSQL keeps a plan: the
 * API functions' first query calls _store_verdict, which the planner
 * folds into a constant, and PostgreSQL plans that query again after any
 * change to the table, its indexes, triggers, rules or policies, the
 * bindings table or the sequence (the relation cache invalidation the C
 * edition listens to), so the catalog is read once per session and per
 * such change, not at every call.  _refuse_write raises what a write
 * must not do under that verdict.
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
