/*-------------------------------------------------------------------------
 *
 * 15_tenant.sql
 *	  Which scopes a caller may use.
 *
 * Mirrors tenant.c's check: _tenant_check raises 42501 unless the caller's
 * binding (and, for a name the session could not SET ROLE to, the session
 * user's) allows the scope.  Every worker calls it with the name its
 * client function passes, because a SECURITY DEFINER function cannot see
 * who called it.  The parts keep the order of the one script they are
 * joined into, so the bindings table's API is a part of its own,
 * 60_bindings.sql.
 *
 *-------------------------------------------------------------------------
 */

/* ---------------------------------------------------------------------
 * Tenant bindings (tenant.c)
 * ---------------------------------------------------------------------
 */

/*
 * Raise 42501 unless "caller" may use "scope".  A worker cannot see who
 * called it, so the client functions pass current_user; a name that the
 * session's own role could not have become by SET ROLE is not trusted on
 * its own, and the session user's binding is checked as well.  So calling
 * a worker directly never gets a role further than SET ROLE would.
 */
CREATE OR REPLACE FUNCTION idempotency._tenant_check(caller name, scope text)
RETURNS void
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
	roles name[] := ARRAY[caller];
	r name;
	prefix text;
BEGIN
	PERFORM idempotency._check_bindings();
	IF NOT EXISTS (SELECT FROM idempotency.scope_bindings) THEN
		RETURN;
	END IF;
	IF EXISTS (SELECT FROM idempotency.scope_bindings b
			   WHERE b.role IS NULL OR b.scope_prefix IS NULL) THEN
		RAISE EXCEPTION 'table "idempotency.scope_bindings" has a row with a NULL role or prefix'
			USING ERRCODE = 'XX001', HINT = 'Someone changed the table''s constraints; delete that row.';
	END IF;
	IF caller OPERATOR(pg_catalog.<>) session_user
	   AND NOT pg_catalog.pg_has_role(session_user, caller, 'MEMBER') THEN
		roles := roles OPERATOR(pg_catalog.||) session_user;
	END IF;
	FOREACH r IN ARRAY roles LOOP
		SELECT b.scope_prefix INTO prefix
		  FROM idempotency.scope_bindings b
		 WHERE b.role::oid OPERATOR(pg_catalog.=)
			   (SELECT a.oid FROM pg_catalog.pg_roles a WHERE a.rolname OPERATOR(pg_catalog.=) r);
		IF FOUND AND NOT pg_catalog.starts_with(scope, prefix) THEN
			RAISE EXCEPTION 'permission denied for idempotency scope "%"', scope
				USING ERRCODE = '42501',
					  DETAIL = pg_catalog.format('Role "%s" may only use scopes that start with "%s".', r, prefix);
		END IF;
	END LOOP;
END;
$$;
