/* idempotency--1.0--1.1.sql: update the idempotency extension from 1.0 to 1.1 */

-- complain if script is sourced in psql, rather than via ALTER EXTENSION
\echo Use "ALTER EXTENSION idempotency UPDATE TO '1.1'" to load this file. \quit

/*
 * 1.1 changes one thing: idem_claim returns SETOF idempotency.claim_result,
 * a named type with the columns and column order of 1.0's RETURNS TABLE.
 * Arguments, defaults, properties and the C function stay as they are, and
 * no stored row is touched.
 */
CREATE TYPE idempotency.claim_result AS (
	outcome			text,
	token			bigint,
	attempt			integer,
	status			text,
	response_code	integer,
	response_body	jsonb,
	retry_after		integer
);

/*
 * A function's return type cannot be changed in place.  The new definition
 * is created under a passing name, takes over the old one's owner and
 * privileges, replaces it, and is renamed to idem_claim.
 */
CREATE FUNCTION idempotency.idem_claim_1_1(
	key			text,
	request		jsonb		DEFAULT NULL,
	scope		text		DEFAULT '',
	lease		interval	DEFAULT NULL,
	retention	interval	DEFAULT NULL,
	wait		interval	DEFAULT '0')
RETURNS SETOF idempotency.claim_result
AS 'MODULE_PATHNAME', 'idem_claim'
LANGUAGE C VOLATILE PARALLEL UNSAFE ROWS 1;

/*
 * 1.0 leaves idem_claim with PostgreSQL's default privileges (EXECUTE for
 * PUBLIC), and so does 1.1: in that case nothing below changes anything.
 * An administrator may have revoked EXECUTE and granted it per role since;
 * those grants, and the owner, carry over unchanged, so that the update
 * neither opens the function to PUBLIC again nor locks a granted role out.
 * Each grant is made by its own grantor, in the order the old ACL lists
 * them.  Grants made in an extension script would be recorded as the
 * extension's initial privileges, which pg_dump does not dump; the record
 * is removed again, so pg_dump still carries them as the administrator's,
 * as it did for 1.0.
 */
DO $$
DECLARE
	old_fn	CONSTANT regprocedure :=
		'idempotency.idem_claim(text,jsonb,text,interval,interval,interval)';
	new_fn	CONSTANT regprocedure :=
		'idempotency.idem_claim_1_1(text,jsonb,text,interval,interval,interval)';
	my_role	CONSTANT text := pg_catalog.current_setting('role');
	owner	name;
	acl		aclitem[];
	item	record;
BEGIN
	SELECT pg_catalog.pg_get_userbyid(p.proowner), p.proacl INTO owner, acl
	  FROM pg_catalog.pg_proc p WHERE p.oid OPERATOR(pg_catalog.=) old_fn;
	EXECUTE pg_catalog.format('ALTER FUNCTION %s OWNER TO %I', new_fn, owner);
	EXECUTE pg_catalog.format('ALTER TYPE idempotency.claim_result OWNER TO %I',
							  owner);
	IF acl IS NULL THEN
		RETURN;
	END IF;

	EXECUTE pg_catalog.format('REVOKE ALL ON FUNCTION %s FROM PUBLIC, %I',
							  new_fn, owner);
	FOR item IN
		SELECT pg_catalog.pg_get_userbyid(a.grantor) AS grantor,
			   CASE WHEN a.grantee OPERATOR(pg_catalog.=) 0 THEN 'PUBLIC'
					ELSE pg_catalog.quote_ident(pg_catalog.pg_get_userbyid(a.grantee))
			   END AS grantee,
			   a.is_grantable
		  FROM pg_catalog.aclexplode(acl) WITH ORDINALITY AS a
		 ORDER BY a.ordinality
	LOOP
		-- a grant someone made with the grant option the owner gave them
		IF item.grantor OPERATOR(pg_catalog.<>) owner THEN
			PERFORM pg_catalog.set_config('role', item.grantor, false);
		END IF;
		EXECUTE pg_catalog.format('GRANT EXECUTE ON FUNCTION %s TO %s%s',
								  new_fn, item.grantee,
								  CASE WHEN item.is_grantable
								  THEN ' WITH GRANT OPTION' ELSE '' END);
		IF item.grantor OPERATOR(pg_catalog.<>) owner THEN
			PERFORM pg_catalog.set_config('role', my_role, false);
		END IF;
	END LOOP;

	DELETE FROM pg_catalog.pg_init_privs i
	 WHERE i.classoid OPERATOR(pg_catalog.=) 'pg_catalog.pg_proc'::regclass
	   AND i.objoid OPERATOR(pg_catalog.=) new_fn;

	/*
	 * From PostgreSQL 17 on, initial privileges also record a shared
	 * dependency (pg_shdepend, deptype 'i') on each role they name.  Left
	 * behind without their record, such a row keeps DROP ROLE failing for a
	 * role even after its grant is revoked.  Before 17 there are no such
	 * rows, and this DELETE finds nothing.
	 */
	DELETE FROM pg_catalog.pg_shdepend d
	 WHERE d.dbid OPERATOR(pg_catalog.=)
			(SELECT db.oid FROM pg_catalog.pg_database db
			  WHERE db.datname OPERATOR(pg_catalog.=) pg_catalog.current_database())
	   AND d.classid OPERATOR(pg_catalog.=) 'pg_catalog.pg_proc'::regclass
	   AND d.objid OPERATOR(pg_catalog.=) new_fn
	   AND d.objsubid OPERATOR(pg_catalog.=) 0
	   AND d.deptype OPERATOR(pg_catalog.=) 'i';
END
$$;

/*
 * A view or a SQL function with a BEGIN ATOMIC body that uses idem_claim
 * depends on it: this DROP then fails with PostgreSQL's dependency error
 * (2BP01) and the whole update rolls back, leaving 1.0 as it was.  Drop
 * those objects, update, and create them again.
 */
DROP FUNCTION idempotency.idem_claim(text, jsonb, text, interval, interval,
									 interval);

ALTER FUNCTION idempotency.idem_claim_1_1(text, jsonb, text, interval,
										  interval, interval)
	RENAME TO idem_claim;
