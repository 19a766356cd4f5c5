-- row 10: in_progress storm: claims of keys pending under a live lease (scope 'busy')
\set k random(1, :nbusy)
SELECT * FROM idempotency.idem_claim(:k, '{"amount": 100}', 'busy');
