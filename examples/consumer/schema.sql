-- schema.sql: the tables of the queue consumer (consumer.py) and of the
-- checkout job (checkout.py).  Run once as a superuser:
--   psql -v ON_ERROR_STOP=1 -f schema.sql

CREATE EXTENSION IF NOT EXISTS idempotency;

-- The consumer's role: USAGE on the extension's schema is all it needs from it.
DO $$
BEGIN
	IF NOT EXISTS (SELECT FROM pg_catalog.pg_roles WHERE rolname = 'ledger_consumer') THEN
		CREATE ROLE ledger_consumer NOLOGIN;
	END IF;
END
$$;
GRANT USAGE ON SCHEMA idempotency TO ledger_consumer;

-- A simple at-least-once queue with visibility timeouts, standing in for a
-- broker such as SQS: a received message is invisible until visible_at, and
-- reappears unless it is deleted (acknowledged) before then.  One row per
-- publish: a producer that retries publishes the same message_id twice.
CREATE TABLE IF NOT EXISTS queue (
	delivery_id		bigserial PRIMARY KEY,
	message_id		text NOT NULL,
	payload			jsonb NOT NULL,
	visible_at		timestamptz NOT NULL DEFAULT now(),
	receive_count	integer NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS queue_visible_at_idx ON queue (visible_at, delivery_id);

-- The side effect: one booking per message.  message_id is deliberately NOT
-- unique, so the tests would see a second booking instead of a constraint
-- hiding it: exactly-once here is the extension's doing.
CREATE TABLE IF NOT EXISTS ledger (
	entry_id	bigserial PRIMARY KEY,
	message_id	text NOT NULL,
	account		text NOT NULL,
	amount		bigint NOT NULL,
	consumer	text NOT NULL,
	booked_at	timestamptz NOT NULL DEFAULT now()
);

-- Messages that reused an id with a different payload (a producer bug).
CREATE TABLE IF NOT EXISTS dead_letters (
	delivery_id	bigint NOT NULL,
	message_id	text NOT NULL,
	payload		jsonb NOT NULL,
	reason		text NOT NULL,
	at			timestamptz NOT NULL DEFAULT now()
);

-- What the consumers did, committed as it happens (outside the business
-- transaction): every receipt and its outcome, and every start of the work.
CREATE TABLE IF NOT EXISTS delivery_log (
	id			bigserial PRIMARY KEY,
	delivery_id	bigint NOT NULL,
	message_id	text NOT NULL,
	consumer	text NOT NULL,
	event		text NOT NULL,	-- received | succeeded | failed | replay | in_progress
							-- | released | mismatch | lost
	at			timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE TABLE IF NOT EXISTS work_log (
	id			bigserial PRIMARY KEY,
	message_id	text NOT NULL,
	consumer	text NOT NULL,
	attempt		integer NOT NULL,
	token		bigint NOT NULL,
	at			timestamptz NOT NULL DEFAULT clock_timestamp()
);

-- checkout.py's two steps: one payment, then one shipment per order.  Again
-- no unique constraint on order_id: a second charge or shipment would be
-- counted, not hidden.  attempt is the attempt that wrote the row.
CREATE TABLE IF NOT EXISTS payments (
	payment_id	bigserial PRIMARY KEY,
	order_id	text NOT NULL,
	account		text NOT NULL,
	amount		bigint NOT NULL,
	worker		text NOT NULL,
	attempt		integer NOT NULL,
	at			timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE TABLE IF NOT EXISTS shipments (
	shipment_id	bigserial PRIMARY KEY,
	order_id	text NOT NULL,
	payment_id	bigint NOT NULL,
	worker		text NOT NULL,
	attempt		integer NOT NULL,
	at			timestamptz NOT NULL DEFAULT clock_timestamp()
);

GRANT SELECT, INSERT, UPDATE, DELETE ON queue TO ledger_consumer;
GRANT SELECT, INSERT ON payments, shipments TO ledger_consumer;
GRANT SELECT, INSERT ON ledger, dead_letters, delivery_log, work_log TO ledger_consumer;
GRANT USAGE ON ALL SEQUENCES IN SCHEMA public TO ledger_consumer;
