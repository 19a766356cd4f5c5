-- row 8 reference: bare primary-key SELECT of the same row
\set k random(1, :nkeys)
SELECT status, fingerprint, response_code, response_body, expires_at FROM idempotency.keys WHERE scope = 'replay' AND key = :k;
