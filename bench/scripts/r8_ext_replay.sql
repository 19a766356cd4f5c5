-- row 8: replay: idem_claim of an existing finished key (scope 'replay', keys 1..:nkeys)
\set k random(1, :nkeys)
SELECT * FROM idempotency.idem_claim(:k, '{"amount": 100}', 'replay');
