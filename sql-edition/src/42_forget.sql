/*-------------------------------------------------------------------------
 *
 * 42_forget.sql
 *	  idem_forget: an operator removes a finished key on purpose.
 *
 * Mirrors forget.c: the one call that deletes a key without its token.  A
 * finished key, live or remembered, goes, so that the next claim of it runs
 * the request again; a pending key is refused (its attempt may still be
 * running), and a key another transaction is changing right now is refused
 * rather than waited on.  The row is deleted under its own lock, taken
 * without waiting.  Not executable by PUBLIC.  Must not decide claims or
 * sweeps.
 *
 *-------------------------------------------------------------------------
 */

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
