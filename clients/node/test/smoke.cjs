// CommonJS entry of the installed package: loads, exports, one job round trip.
'use strict';
const assert = require('node:assert/strict');
const path = require('node:path');
const pg = require('pg');
const idem = require('pg-idempotency');

assert.match(require.resolve('pg-idempotency'), new RegExp(`node_modules\\${path.sep}pg-idempotency\\${path.sep}lib\\${path.sep}index\\.cjs$`));
for (const name of ['idempotent', 'expressIdempotency', 'fastifyIdempotency', 'rawBody', 'idempotencyContext', 'parseIdempotencyKey', 'completer'])
	assert.equal(typeof idem[name], 'function', name);
assert.equal(idem.fastifyIdempotency[Symbol.for('skip-override')], true);

(async () => {
	const pool = new pg.Pool({ max: 2 });
	const key = `smoke-cjs-${process.pid}-${Date.now()}`;
	const first = await idem.idempotent(pool, { key }, async () => ({ from: 'cjs' }));
	const again = await idem.idempotent(pool, { key }, async () => ({ from: 'twice' }));
	assert.equal(first.replayed, false);
	assert.deepEqual(again, { replayed: true, value: { from: 'cjs' }, attempt: null, token: null });
	await pool.end();
	console.log('CommonJS entry: ok');
})().catch((err) => {
	console.error(err);
	process.exit(1);
});
