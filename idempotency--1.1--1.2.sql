/* idempotency--1.1--1.2.sql: update the idempotency extension from 1.1 to 1.2 */

-- complain if script is sourced in psql, rather than via ALTER EXTENSION
\echo Use "ALTER EXTENSION idempotency UPDATE TO '1.2'" to load this file. \quit

/*
 * 1.2 adds idem_version() and changes no other object; no stored row is
 * touched.
 */
CREATE FUNCTION idempotency.idem_version()
RETURNS text
AS 'MODULE_PATHNAME', 'idem_version'
LANGUAGE C STABLE PARALLEL SAFE;

/*
 * On PostgreSQL 17 and later, the update from 1.0 to 1.1 as first released
 * removed idem_claim's initial privileges but left the shared dependencies
 * on roles that PostgreSQL records with them (pg_shdepend, deptype 'i').
 * Such a row keeps DROP ROLE failing for a role that was granted EXECUTE on
 * idem_claim, even after the grant is revoked.  The rows of idem_claim in
 * this database that no initial privileges back any more go.  Before 17
 * there are no such rows, nor in a database that was installed as 1.1 or
 * updated to it by the current script.
 */
DELETE FROM pg_catalog.pg_shdepend d
 WHERE d.dbid OPERATOR(pg_catalog.=)
		(SELECT db.oid FROM pg_catalog.pg_database db
		  WHERE db.datname OPERATOR(pg_catalog.=) pg_catalog.current_database())
   AND d.classid OPERATOR(pg_catalog.=) 'pg_catalog.pg_proc'::regclass
   AND d.objid OPERATOR(pg_catalog.=)
		'idempotency.idem_claim(text,jsonb,text,interval,interval,interval)'::regprocedure
   AND d.deptype OPERATOR(pg_catalog.=) 'i'
   AND NOT EXISTS (SELECT FROM pg_catalog.pg_init_privs i
					WHERE i.classoid OPERATOR(pg_catalog.=) d.classid
					  AND i.objoid OPERATOR(pg_catalog.=) d.objid
					  AND i.objsubid OPERATOR(pg_catalog.=) d.objsubid);
