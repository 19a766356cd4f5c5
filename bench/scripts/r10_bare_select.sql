-- row 10 reference: bare primary-key SELECT of the same pending row
\set k random(1, :nbusy)
SELECT status, token, fingerprint, lease_until FROM idempotency.keys WHERE scope = 'busy' AND key = :k;
