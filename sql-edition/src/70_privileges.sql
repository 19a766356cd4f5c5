/*-------------------------------------------------------------------------
 *
 * 70_privileges.sql
 *	  What PUBLIC may execute, and the functions older versions left.
 *
 * Runs last, when every function exists.  The API functions are SECURITY
 * DEFINER and take no identity from an argument (15_tenant.sql); every
 * helper (a name that starts with "_") runs only inside them, so PUBLIC
 * may execute none of them, and the helpers of older versions, whose
 * workers took the caller's role as an argument, are dropped.  An API
 * function whose arguments or result columns changed keeps the owner and
 * privileges of the one it replaces (01_update.sql).
 *
 *-------------------------------------------------------------------------
 */

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
