// Options read at construction and at the first claim: maxBodySize (a
// limit in bytes; null or 0 none; absent 1 MiB; refused when negative or
// fractional; enforced with a fingerprint option too), wait (seconds, refused
// when negative or not a number) and the server's
// idempotency.max_response_size with the units PostgreSQL allows.
import { test, describe, after } from 'node:test';
import assert from 'node:assert/strict';
import pg from 'pg';
import express from 'express';
import { expressIdempotency, fastifyIdempotency } from 'pg-idempotency';
import { db, row, newKey, send, exchange, frameworks, listen } from './helpers.mjs';

const pool = new pg.Pool({ max: 6 });

after(async () => {
	await pool.end();
	await db.end();
});

function sendChunked(baseUrl, path, { key, parts }) {
	return exchange(baseUrl + path, {
		headers: { 'content-type': 'application/octet-stream', 'idempotency-key': key },
		parts,
	});
}

/* an app with no body parser: the middleware reads every byte itself */
async function bare(options) {
	const app = express();
	app.post('/x', expressIdempotency({ pool, ...options }), (req, res) => res.status(201).json({ bytes: req.rawBody.length }));
	return listen(app);
}

describe('wait', () => {
	test('a negative or non-number wait fails at construction', async () => {
		for (const bad of [-1, '5', Number.NaN, Infinity]) {
			assert.throws(() => expressIdempotency({ pool, wait: bad }), /wait must be a number of seconds/, String(bad));
			const fastify = (await import('fastify')).default();
			await assert.rejects(fastify.register(fastifyIdempotency, { pool, wait: bad }).ready(),
				/wait must be a number of seconds/, String(bad));
			await fastify.close();
		}
	});
});

describe('maxBodySize', () => {
	test('null and 0 mean no limit; absent means 1 MiB', async () => {
		const body = Buffer.alloc(1536 * 1024, 'z');
		for (const [options, status] of [[{ maxBodySize: null }, 201], [{ maxBodySize: 0 }, 201], [{}, 413]]) {
			const app = await bare(options);
			try {
				const key = newKey();
				const answer = await send(app.url, '/x', { key, body, type: 'application/octet-stream' });
				assert.equal(answer.status, status, `${JSON.stringify(options)}: ${answer.text.slice(0, 200)}`);
				if (status === 201)
					assert.deepEqual(JSON.parse(answer.text), { bytes: body.length });
				else
					assert.equal(await row(key), null);
			} finally {
				await app.close();
			}
		}
	});

	test('a negative, fractional or non-number limit fails at construction', async () => {
		for (const bad of [-1, 1.5, '1000', Number.NaN, Infinity]) {
			assert.throws(() => expressIdempotency({ pool, maxBodySize: bad }), TypeError, String(bad));
			const fastify = (await import('fastify')).default();
			await assert.rejects(fastify.register(fastifyIdempotency, { pool, maxBodySize: bad }).ready(), TypeError, String(bad));
			await fastify.close();
		}
	});

	for (const fw of frameworks) {
		test(`${fw.name}: with a fingerprint option, a body over the limit is still refused, declared or chunked`, async () => {
			const app = await fw.start({ pool, maxBodySize: 1000, fingerprint: () => ({ fixed: true }) });
			try {
				const declared = newKey();
				const over = await send(app.url, '/echo', { key: declared, body: Buffer.alloc(1200, 'a'), type: 'application/octet-stream' });
				assert.equal(over.status, 413, over.text);
				assert.equal(await row(declared), null);
				const chunked = newKey();
				const overChunked = await sendChunked(app.url, '/echo', { key: chunked, parts: [Buffer.alloc(600, 'a'), Buffer.alloc(600, 'b')] });
				assert.equal(overChunked.status, 413, overChunked.text);
				assert.equal(await row(chunked), null);
				const fits = await sendChunked(app.url, '/echo', { key: chunked, parts: [Buffer.alloc(450, 'a'), Buffer.alloc(450, 'b')] });
				assert.equal(fits.status, 201, fits.text);
				assert.equal((await row(chunked)).status, 'succeeded');
				assert.equal(app.control.count(chunked), 1);
			} finally {
				await app.close();
			}
		});
	}
});

/*
 * What pg_settings shows for idempotency.max_response_size: a number of its
 * unit once the library is loaded in the session, the text as written
 * before.  A pool whose settings row says so, and the limit the client logs.
 */
describe('idempotency.max_response_size', () => {
	const cases = [
		['2MB', null, 2 * 1024 * 1024],
		['512 kB', null, 512 * 1024],
		['1GB', null, 1024 ** 3],
		['300000', null, 300000],
		['2048', 'kB', 2 * 1024 * 1024],
		['1048576', 'B', 1048576],
		['16', '8kB', 16 * 8 * 1024],
		['2 MB', 'B', 2 * 1024 * 1024],
		['lots', null, 1048576],
		['2XB', null, 1048576],
		['', null, 1048576],
		['-5', null, 1048576],
		['10', 'furlongs', 1048576],
	];
	for (const [setting, unit, bytes] of cases) {
		test(`setting ${JSON.stringify(setting)}, unit ${JSON.stringify(unit)}: ${bytes} bytes`, async () => {
			const shown = {
				options: pool.options,
				connect: () => pool.connect(),
				query: async (sql, params) => {
					const result = await pool.query(sql, params);
					if (/pg_settings/.test(sql))
						result.rows[0] = { ...result.rows[0], max_response_size: setting, max_response_size_unit: unit };
					return result;
				},
			};
			const logs = [];
			const app = await bare({ pool: shown, log: (message) => logs.push(message) });
			try {
				assert.equal((await send(app.url, '/x', { key: newKey() })).status, 201);
				const said = logs.find((m) => /responses over/.test(m));
				assert.match(said ?? '', new RegExp(`responses over ${bytes} bytes`), logs.join('\n'));
			} finally {
				await app.close();
			}
		});
	}
});
