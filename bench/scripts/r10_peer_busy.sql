-- row 10 peer: in_progress storm: claims of keys pending under a live lease (scope 'busy')
\set k random(1, :nbusy)
SELECT * FROM idem_plpgsql.idem_claim(:k, '{"amount": 100}', 'busy');
