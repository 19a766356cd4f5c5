-- schema.sql: what the orders service and its completer need in their database.
-- Run once as a superuser (CREATE EXTENSION needs one):
--   psql -v ON_ERROR_STOP=1 -f schema.sql

CREATE EXTENSION IF NOT EXISTS idempotency;

-- The role of the service and of the completer.  It needs no privilege on
-- the extension's table: USAGE on the schema lets it call the functions
-- (idem_claim_abandoned is granted to PUBLIC like idem_claim), and LISTEN
-- needs no privilege at all.
DO $$
BEGIN
	IF NOT EXISTS (SELECT FROM pg_catalog.pg_roles WHERE rolname = 'orders_app') THEN
		CREATE ROLE orders_app NOLOGIN;
	END IF;
END
$$;
GRANT USAGE ON SCHEMA idempotency TO orders_app;
