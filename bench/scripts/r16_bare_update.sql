-- row 16, reference: the same transaction with a bare UPDATE of the same two
-- columns of the same key in a plain copy of the keys table (same columns
-- and indexes), checking the token and status as idem_checkpoint does
\set i :client_id * :per + random(1, :per)
BEGIN;
INSERT INTO bench.orders (scope, key, amount) VALUES (:scope, :i, 100);
UPDATE bench.ckpt_plain SET phase = 'step', phase_data = '{"id": 1}' WHERE scope = 'ckpt' AND key = :i AND token = :i AND status = 'pending';
COMMIT;
