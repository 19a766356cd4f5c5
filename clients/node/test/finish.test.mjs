// After the handler ran: a handler past handlerTimeout in transactional mode
// frees its connection and its key at once, and a late throw ends its
// attempt.  Express 5, Express 4 and Fastify alike.
import { test, describe, before, after } from 'node:test';
import assert from 'node:assert/strict';
import pg from 'pg';
import { db, row, newKey, send, problemOf, waitFor, frameworks } from './helpers.mjs';

const pool = new pg.Pool({ max: 10 });

before(async () => {
	await db.query(`CREATE TABLE IF NOT EXISTS test_orders (
		id bigserial PRIMARY KEY, request_key text NOT NULL, note text)`);
});

after(async () => {
	await pool.end();
	await db.end();
});

async function ordersFor(key) {
	const { rows } = await db.query('SELECT note FROM test_orders WHERE request_key = $1', [key]);
	return rows.map((r) => r.note);
}

const checkedOut = (p) => p.totalCount - p.idleCount;

async function idleInTransaction() {
	const { rows } = await db.query(
		`SELECT count(*)::int AS n FROM pg_stat_activity
		  WHERE datname = current_database() AND state LIKE 'idle in transaction%'`);
	return rows[0].n;
}

for (const fw of frameworks) {
	describe(fw.name, () => {
		test('handlerTimeout, transactional: at the 504 the connection returns to the pool and the key is free at once', async () => {
			const app = await fw.start({ pool, handlerTimeout: 1 });
			try {
				const busyBefore = checkedOut(pool);
				const key = newKey();
				const gate = app.control.gate(key);
				problemOf(await send(app.url, '/tx', { key, body: '{"note":"late"}' }), 504, 'idempotency-handler-timeout');
				assert.equal((await gate.entered.promise).signal.aborted, true);
				// the handler still waits; its transaction is gone all the same
				await waitFor(() => checkedOut(pool) === busyBefore, 'the connection back in the pool');
				await waitFor(async () => (await idleInTransaction()) === 0, 'no session idle in transaction');
				app.control.gates.delete(key);
				const retry = await send(app.url, '/tx', { key, body: '{"note":"again"}' });
				assert.equal(retry.status, 201, retry.text);
				assert.equal(JSON.parse(retry.text).attempt, 1);
				assert.equal((await row(key)).attempt, 1);
				// the late handler ends; its answer is dropped and nothing of it is stored
				gate.release.resolve();
				await waitFor(() => checkedOut(pool) === busyBefore, 'the pool at rest');
				assert.deepEqual(await ordersFor(key), ['again']);
				const replay = await send(app.url, '/tx', { key, body: '{"note":"again"}' });
				assert.equal(replay.headers['idempotent-replayed'], 'true');
				assert.equal(app.control.count(key), 2);
			} finally {
				await app.close();
			}
		});

		/* Fastify only logs an error thrown after its reply went out: there the key waits for its lease */
		if (fw.name !== 'fastify') test('handlerTimeout, autocommit: a handler that throws after its 504 releases the key', async () => {
			const app = await fw.start({ pool, handlerTimeout: 1, lease: 120 });
			try {
				const key = newKey();
				const gate = app.control.gate(key);
				problemOf(await send(app.url, '/slow-throw', { key }), 504, 'idempotency-handler-timeout');
				await gate.entered.promise;
				assert.equal((await row(key)).status, 'pending');
				gate.release.resolve();
				await waitFor(async () => (await row(key)) === null, 'the key released', 10000);
				app.control.gates.delete(key);
				// the key is free: a new request with it is claimed afresh
				const retry = await send(app.url, '/echo', { key });
				assert.equal(retry.status, 201, retry.text);
				assert.equal(JSON.parse(retry.text).attempt, 1);
			} finally {
				await app.close();
			}
		});

	});
}
