-- row 8 peer: the PL/pgSQL peer's replay of an existing finished key
\set k random(1, :nkeys)
SELECT * FROM idem_plpgsql.idem_claim(:k, '{"amount": 100}', 'replay');
