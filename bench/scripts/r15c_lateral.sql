-- row 15c: the same batch as row 15a through the one-key functions, one
-- statement each: LATERAL idem_claim over unnest(keys), one INSERT ... SELECT
-- of the business rows, LATERAL idem_finish over unnest(keys, tokens), COMMIT
\set k random(1, 1000000000000000000)
BEGIN;
SELECT array_agg(u.k ORDER BY u.i) AS ks, array_agg(c.token ORDER BY u.i) AS ts FROM unnest(ARRAY(SELECT :k || '-' || g FROM generate_series(1, :batch::int) g)) WITH ORDINALITY AS u(k, i), LATERAL idempotency.idem_claim(u.k, '{"amount": 100}', :scope) c WHERE c.outcome = 'claimed' \gset
INSERT INTO bench.orders (scope, key, amount) SELECT :scope, unnest(:ks::text[]), 100;
SELECT count(f.f) FROM unnest(:ks::text[], :ts::bigint[]) AS u(k, t), LATERAL idempotency.idem_finish(u.k, u.t, 200, '{"id": 1, "ok": true}', :scope) AS f(f);
COMMIT;
