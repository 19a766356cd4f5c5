-- schema.sql: what the payments service needs in its database.
-- Run once as a superuser (CREATE EXTENSION needs one):
--   psql -v ON_ERROR_STOP=1 -f schema.sql

CREATE EXTENSION IF NOT EXISTS idempotency;

-- The service's role.  It needs no privilege on the extension's table:
-- USAGE on the schema lets it call the client functions, nothing more.
DO $$
BEGIN
	IF NOT EXISTS (SELECT FROM pg_catalog.pg_roles WHERE rolname = 'payments_app') THEN
		CREATE ROLE payments_app NOLOGIN;
	END IF;
END
$$;
GRANT USAGE ON SCHEMA idempotency TO payments_app;

-- The business table of the in-transaction endpoint (POST /orders).
-- request_key is deliberately NOT unique: the tests count rows per key, so a
-- second execution would show up instead of being hidden by a constraint.
CREATE TABLE IF NOT EXISTS orders (
	id			bigserial PRIMARY KEY,
	request_key	text NOT NULL,
	item		text NOT NULL,
	quantity	integer NOT NULL,
	created_at	timestamptz NOT NULL DEFAULT now()
);
GRANT SELECT, INSERT ON orders TO payments_app;
GRANT USAGE ON SEQUENCE orders_id_seq TO payments_app;

-- The second step of the resumable endpoint (POST /checkout): one shipment per
-- request, for the charge of its first step.  Not unique either.
CREATE TABLE IF NOT EXISTS shipments (
	id			bigserial PRIMARY KEY,
	request_key	text NOT NULL,
	charge		text NOT NULL,
	created_at	timestamptz NOT NULL DEFAULT now()
);
GRANT SELECT, INSERT ON shipments TO payments_app;
GRANT USAGE ON SEQUENCE shipments_id_seq TO payments_app;
