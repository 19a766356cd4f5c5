// Bodies byte for byte (JSON as PostgreSQL keeps it, bodies jsonb cannot
// hold), stored headers, a storePolicy that throws, and the replay cache's
// expiry, for the Express middleware and the Fastify plugin alike.
import { test, describe, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { createHash } from 'node:crypto';
import { gunzipSync } from 'node:zlib';
import pg from 'pg';
import { defaultStorePolicy } from 'pg-idempotency';
import { db, row, newKey, send, waitFor, frameworks, createTestOrders } from './helpers.mjs';

const pool = new pg.Pool({ max: 10 });

before(async () => {
	await createTestOrders();
});

after(async () => {
	await pool.end();
	await db.end();
});

const raw = (url, key, body) => send(url, '/echo-raw', { key, body, type: 'application/octet-stream' });

async function pgText(key) {
	const { rows } = await db.query(
		"SELECT (response_body -> 'json')::text AS t FROM idempotency.keys WHERE key = $1 AND scope = ''", [key]);
	return rows[0].t;
}

/* claim and finish a key directly, as another client would */
async function settle(key, envelope, requestBody = null) {
	const request = requestBody === null ? null : JSON.stringify({
		method: 'POST', path: '/echo-raw', body_sha256: createHash('sha256').update(requestBody).digest('hex'),
	});
	const { rows } = await db.query('SELECT token::text FROM idempotency.idem_claim(key => $1, request => $2::jsonb)', [key, request]);
	await db.query("SELECT idempotency.idem_finish($1, $2::bigint, 200, $3::jsonb, retention => '1 hour')",
		[key, rows[0].token, JSON.stringify(envelope)]);
}

for (const fw of frameworks) {
	describe(`${fw.name}`, () => {
		let app;
		before(async () => { app = await fw.start({ pool }); });
		after(async () => { await app.close(); });

		test('a JSON body is PostgreSQL\'s text of it, first and on replay', async () => {
			const key = newKey();
			const first = await raw(app.url, key, '{"zeta": 1, "a": 10.50, "n": 1e2}');
			assert.equal(first.text, '{"a": 10.50, "n": 100, "zeta": 1}');
			assert.equal(first.text, await pgText(key));
			assert.equal(first.headers.etag, undefined, 'the ETag named the bytes the handler wrote');
			const again = await raw(app.url, key, '{"zeta": 1, "a": 10.50, "n": 1e2}');
			assert.deepEqual(again.bytes, first.bytes);
		});

		test('a number only numeric holds is stored as JSON', async () => {
			const key = newKey();
			const first = await raw(app.url, key, '{"x": 1e400}');
			assert.equal(first.status, 200, first.text);
			const r = await row(key);
			assert.equal(r.response_body.base64, undefined);
			assert.equal(first.text, `{"x": 1${'0'.repeat(400)}}`);
			assert.equal(first.text, await pgText(key));
			assert.deepEqual((await raw(app.url, key, '{"x": 1e400}')).bytes, first.bytes);
		});

		for (const body of ['["\\ud800"]', '{"s": "a\\u0000b"}', '["\\uD83D\\uDE00"]']) {
			test(`JSON that jsonb refuses is stored as base64: ${body}`, async () => {
				const key = newKey();
				const first = await raw(app.url, key, body);
				assert.equal(first.status, 200, first.text);
				assert.equal(first.text, body);
				const r = await row(key);
				assert.equal(r.response_body.json, undefined);
				assert.equal(r.response_body.base64, Buffer.from(body).toString('base64'));
				const again = await raw(app.url, key, body);
				assert.equal(again.headers['idempotent-replayed'], 'true');
				assert.equal(again.text, body);
			});
		}

		test('content-encoding is stored: a compressed body replays with its encoding', async () => {
			const key = newKey();
			const first = await send(app.url, '/gzip', { key });
			assert.equal(first.headers['content-encoding'], 'gzip');
			assert.equal(gunzipSync(first.bytes).toString(), '{"packed": true}');
			assert.equal((await row(key)).response_body.headers['content-encoding'], 'gzip');
			const again = await send(app.url, '/gzip', { key });
			assert.equal(again.headers['idempotent-replayed'], 'true');
			assert.equal(again.headers['content-encoding'], 'gzip');
			assert.deepEqual(again.bytes, first.bytes);
		});

		test('204: no content-length, first or on replay', async () => {
			const key = newKey();
			const first = await send(app.url, '/empty', { key });
			const again = await send(app.url, '/empty', { key });
			assert.equal(again.headers['idempotent-replayed'], 'true');
			for (const a of [first, again]) {
				assert.equal(a.status, 204);
				assert.equal(a.headers['content-length'], undefined);
			}
		});

		test('a storePolicy that throws: the framework\'s 500, the key and the connection given back', async () => {
			const own = new pg.Pool({ max: 2 });
			let broken = true;
			const policyApp = await fw.start({
				pool: own,
				storePolicy: (status) => {
					if (broken)
						throw new Error('policy broke');
					return defaultStorePolicy(status);
				},
			});
			try {
				for (const path of ['/echo', '/tx']) {
					broken = true;
					const key = newKey();
					const failed = await send(policyApp.url, path, { key, body: '{"note":"x"}' });
					assert.equal(failed.status, 500, failed.text);
					await waitFor(() => own.idleCount === own.totalCount, 'every client back in the pool', 5000);
					assert.equal(await row(key), null, 'nothing stored, the key released');
					broken = false;
					const retried = await send(policyApp.url, path, { key, body: '{"note":"x"}' });
					assert.equal(retried.status, 201, retried.text);
					assert.equal(retried.headers['idempotent-replayed'], undefined);
					assert.equal((await row(key)).attempt, 1);
				}
				const { rows } = await db.query('SELECT count(*)::int AS n FROM test_orders WHERE note = $1 AND request_key LIKE $2', ['x', 'k-%']);
				assert.ok(rows[0].n >= 1);
			} finally {
				await policyApp.close();
				await own.end();
			}
		});

		test('a replay whose key is settled anew before the cache lookup is served, not cached', async () => {
			let hook = null;
			const hooked = {
				async query(sql, params) {
					if (hook && /idem_lookup/.test(sql))
						await hook();
					return pool.query(sql, params);
				},
				connect: () => pool.connect(),
			};
			const cached = await fw.start({ pool: hooked, cache: { max: 10 } });
			try {
				const key = newKey();
				await settle(key, { v: 1, headers: { 'content-type': 'application/json' }, json: { old: 1 } }, Buffer.from('{}'));
				hook = async () => {
					hook = null;
					await db.query('DELETE FROM idempotency.keys WHERE key = $1', [key]);
					await settle(key, { v: 1, headers: {}, json: { new: 1 } }, Buffer.from('{}'));
				};
				const r = await raw(cached.url, key, '{}');
				assert.equal(r.headers['idempotent-replayed'], 'true');
				assert.deepEqual(JSON.parse(r.text), { old: 1 });
				const again = await raw(cached.url, key, '{}');
				assert.deepEqual(JSON.parse(again.text), { new: 1 }, 'the database answered, not a cached old result');
			} finally {
				await cached.close();
			}
		});
	});
}
