-- row 6: the PL/pgSQL peer (bench/plpgsql_peer.sql), autocommit: claim then finish
\set k random(1, 1000000000000000000)
SELECT token FROM idem_plpgsql.idem_claim(:k, '{"amount": 100}', :scope) \gset
SELECT idem_plpgsql.idem_finish(:k, :token, 200, '{"id": 1, "ok": true}', :scope);
