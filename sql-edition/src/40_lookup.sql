/*-------------------------------------------------------------------------
 *
 * 40_lookup.sql
 *	  idem_lookup: what is stored under a key, without claiming it.
 *
 * Mirrors lookup.c.  The worker _w_lookup reads through the caller's
 * snapshot, as the C edition's lookup does, and never writes or waits.
 *
 *-------------------------------------------------------------------------
 */

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
