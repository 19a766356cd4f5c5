// ESM entry of the installed package: loads, shares the CommonJS instance, one job round trip.
import assert from 'node:assert/strict';
import { createRequire } from 'node:module';
import pg from 'pg';
import * as idem from 'pg-idempotency';

const require = createRequire(import.meta.url);
assert.match(import.meta.resolve('pg-idempotency'), /node_modules\/pg-idempotency\/lib\/index\.mjs$/);
assert.equal(idem.InProgressError, require('pg-idempotency').InProgressError, 'one module instance for both entries');
assert.equal(idem.MAX_KEY_LENGTH, 255);

const pool = new pg.Pool({ max: 2 });
const key = `smoke-esm-${process.pid}-${Date.now()}`;
const first = await idem.idempotent(pool, { key, request: { a: 1 } }, async () => 'esm');
await assert.rejects(idem.idempotent(pool, { key, request: { a: 2 } }, async () => 'x'), idem.MismatchError);
assert.equal(first.value, 'esm');
await pool.end();
console.log('ESM entry: ok');
