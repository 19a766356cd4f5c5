/*-------------------------------------------------------------------------
 *
 * 40_lookup.sql
 *	  idem_lookup: what is stored under a key, without claiming it.
 *
 * Mirrors lookup.c.  One query reads the key through the caller's
 * snapshot, as the C edition's lookup does, with the caller's binding and
 * the store's verdict; it never writes or waits.  A key past its retention
 * is absent, as it is to a claim, unless it is remembered: then its
 * outcome shows without its response, even before a sweep compacts it.
 *
 *-------------------------------------------------------------------------
 */

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
