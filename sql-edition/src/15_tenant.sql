/*-------------------------------------------------------------------------
 *
 * 15_tenant.sql
 *	  Who is calling, and which scopes that role may use.
 *
 * Mirrors tenant.c's check.  The API functions run with their owner's
 * rights (SECURITY DEFINER), where current_user is the owner: _caller
 * names the role the session acts as, which the session cannot forge, and
 * every API function looks that role's binding up in the same query that
 * reads the key, so a call whose scope the binding does not allow is
 * refused (42501, _tenant_refuse) before anything of the key is used.
 * The parts keep the order of the one script they are joined into, so the
 * bindings table's API is a part of its own, 60_bindings.sql.
 *
 *-------------------------------------------------------------------------
 */

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
