-- row 9 bound: the storm's clients doing nothing but a bare primary-key
-- SELECT of one of 100 hot finished keys: the least any storm op can do
\set k random(1, 100)
SELECT status, fingerprint, response_code, response_body, expires_at FROM idempotency.keys WHERE scope = 'replay' AND key = :k;
