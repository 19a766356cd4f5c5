/*-------------------------------------------------------------------------
 *
 * 01_update.sql
 *	  Updating in place a function whose arguments or result columns
 *	  changed.
 *
 * Mirrors what the C edition's update scripts do with such a function
 * (update_take_over in idempotency--1.3--1.4.sql).  CREATE OR REPLACE
 * cannot change a function's arguments or result columns, so the part
 * that owns such a function sets the older version's aside just before it
 * creates the new one (_update_set_aside), and 70_privileges.sql gives
 * each new API function the owner and privileges of the one it replaces,
 * drops that one (_update_take_over), and then drops these two helpers:
 * they exist only while the script runs.  Nothing here touches a key.
 *
 *-------------------------------------------------------------------------
 */

/*
 * Set aside function "fn" (its signature, as to_regprocedure reads it) of
 * an older version when it exists and, if "unless_arg" is given, has no
 * argument of that name (the new version's has one: it stays).  A helper
 * (a name that starts with "_") is dropped, as only the API functions call
 * it.  An API function is renamed _parked_NAME: a view may use it until its
 * part replaces the view, and its owner and privileges go to its successor
 * at the end (_update_take_over).
 */
CREATE OR REPLACE FUNCTION idempotency._update_set_aside(fn text, unless_arg text DEFAULT NULL)
RETURNS void
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
	f regprocedure := pg_catalog.to_regprocedure(fn);
	p record;
BEGIN
	IF f IS NULL THEN
		RETURN;
	END IF;
	SELECT pr.proname, pr.proargnames INTO p
	  FROM pg_catalog.pg_proc pr WHERE pr.oid OPERATOR(pg_catalog.=) f;
	IF unless_arg OPERATOR(pg_catalog.=) ANY (p.proargnames) THEN
		RETURN;
	END IF;
	IF pg_catalog.starts_with(p.proname::text, '_') THEN
		EXECUTE pg_catalog.format('DROP FUNCTION %s', f);
	ELSE
		EXECUTE pg_catalog.format('ALTER FUNCTION %s RENAME TO %I', f,
			'_parked_' OPERATOR(pg_catalog.||) p.proname);
	END IF;
END;
$$;

/*
 * Give each API function the owner and privileges of the older version's
 * that _update_set_aside parked, and drop that one.  The privileges are
 * granted again in the order the old ACL lists them, each by its grantor
 * where the role running the script may act as that role, else by the
 * owner (the grantee keeps its privilege; only the grantor recorded
 * differs).  A function whose ACL was the default keeps the default.
 */
CREATE OR REPLACE FUNCTION idempotency._update_take_over()
RETURNS void
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
	my_role text := pg_catalog.current_setting('role');
	old record;
	fn regprocedure;
	owner name;
	item record;
	stmt text;
BEGIN
	FOR old IN
		SELECT p.oid::regprocedure AS fn, pg_catalog.substr(p.proname::text, 9) AS name,
			   pg_catalog.pg_get_userbyid(p.proowner) AS owner, p.proacl AS acl
		  FROM pg_catalog.pg_proc p
		 WHERE p.pronamespace OPERATOR(pg_catalog.=) 'idempotency'::regnamespace
		   AND pg_catalog.starts_with(p.proname::text, '_parked_')
	LOOP
		-- every API function has one signature
		SELECT p.oid::regprocedure, pg_catalog.pg_get_userbyid(p.proowner) INTO fn, owner
		  FROM pg_catalog.pg_proc p
		 WHERE p.pronamespace OPERATOR(pg_catalog.=) 'idempotency'::regnamespace
		   AND p.proname OPERATOR(pg_catalog.=) old.name;
		IF owner OPERATOR(pg_catalog.<>) old.owner THEN
			EXECUTE pg_catalog.format('ALTER FUNCTION %s OWNER TO %I', fn, old.owner);
		END IF;
		IF old.acl IS NOT NULL THEN
			EXECUTE pg_catalog.format('REVOKE ALL ON FUNCTION %s FROM PUBLIC, %I', fn, old.owner);
			FOR item IN
				SELECT pg_catalog.pg_get_userbyid(a.grantor) AS grantor,
					   CASE WHEN a.grantee OPERATOR(pg_catalog.=) 0 THEN 'PUBLIC'
							ELSE pg_catalog.quote_ident(pg_catalog.pg_get_userbyid(a.grantee)) END AS grantee,
					   a.is_grantable
				  FROM pg_catalog.aclexplode(old.acl) WITH ORDINALITY a
				 ORDER BY a.ordinality
			LOOP
				stmt := pg_catalog.format('GRANT EXECUTE ON FUNCTION %s TO %s%s', fn, item.grantee,
					CASE WHEN item.is_grantable THEN ' WITH GRANT OPTION' ELSE '' END);
				IF item.grantor OPERATOR(pg_catalog.=) old.owner THEN
					EXECUTE stmt;
				ELSE
					BEGIN
						PERFORM pg_catalog.set_config('role', item.grantor, true);
						EXECUTE stmt;
						PERFORM pg_catalog.set_config('role', my_role, true);
					EXCEPTION WHEN insufficient_privilege THEN
						EXECUTE stmt;
					END;
				END IF;
			END LOOP;
		END IF;
		EXECUTE pg_catalog.format('DROP FUNCTION %s', old.fn);
	END LOOP;
END;
$$;
