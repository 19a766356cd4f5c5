/*-------------------------------------------------------------------------
 *
 * 50_version.sql
 *	  idem_version.
 *
 * Mirrors module.c's idem_version: the C library's version of the same
 * release.  scripts/sql-edition.sh fills in @IDEM_VERSION@ from
 * src/idempotency.h when it builds the installers, so that both editions
 * of one release answer the same.
 *
 *-------------------------------------------------------------------------
 */

/*
 * The version of the contract this edition implements, with the C
 * edition's library version number of the same release (filled in by
 * scripts/sql-edition.sh from src/idempotency.h).
 */
CREATE OR REPLACE FUNCTION idempotency.idem_version()
RETURNS text
LANGUAGE sql STABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
RETURN '@IDEM_VERSION@';
