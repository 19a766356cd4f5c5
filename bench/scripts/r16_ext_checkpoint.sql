-- row 16: one step of a pending key's work in one transaction: the step's
-- business INSERT and idem_checkpoint.  Keys '1'..'n' of scope 'ckpt' are
-- pending with token = key (filled by bench/run); each client keeps to its
-- own :per keys, so two clients never hold the same key at once
\set i :client_id * :per + random(1, :per)
BEGIN;
INSERT INTO bench.orders (scope, key, amount) VALUES (:scope, :i, 100);
SELECT idempotency.idem_checkpoint(:i, :i, 'step', '{"id": 1}', 'ckpt');
COMMIT;
