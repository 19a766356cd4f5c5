/*-------------------------------------------------------------------------
 *
 * 60_bindings.sql
 *	  bind_scope and unbind_scope, and the bindings table's trigger.
 *
 * Mirrors the API of tenant.c and the C edition's idempotency--1.6.sql.
 * The SQL edition reads the caller's binding in each call's first query,
 * so its trigger has nothing to tell; it stays so that both editions have
 * the same objects.  The check every call makes is in 15_tenant.sql.
 *
 *-------------------------------------------------------------------------
 */

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
