-- row 15a: a consumer's batch of :batch fresh keys in one transaction:
-- idem_claim_many, one INSERT ... SELECT of the business rows of the claimed
-- keys, idem_finish_many, COMMIT.  It finishes the keys answered 'claimed'
-- (bench/run's check counts them): the SQL edition (row 22) can answer
-- in_progress for a fresh key when its insert waits more than 1 ms for a lock
\set k random(1, 1000000000000000000)
BEGIN;
SELECT coalesce(array_agg(c.key ORDER BY c.ord), '{}') AS ks, coalesce(array_agg(c.token ORDER BY c.ord), '{}') AS ts FROM idempotency.idem_claim_many(ARRAY(SELECT :k || '-' || g FROM generate_series(1, :batch::int) g), array_fill('{"amount": 100}'::jsonb, ARRAY[:batch::int]), :scope) c WHERE c.outcome = 'claimed' \gset
INSERT INTO bench.orders (scope, key, amount) SELECT :scope, unnest(:ks::text[]), 100;
SELECT count(*) FROM idempotency.idem_finish_many(:ks::text[], :ts::bigint[], array_fill(200, ARRAY[cardinality(:ks::text[])]), array_fill('{"id": 1, "ok": true}'::jsonb, ARRAY[cardinality(:ks::text[])]), :scope);
COMMIT;
